cd /work/wt-user
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
date -u; cat /proc/loadavg
for cmd in \
 'specdec generate --message "user:Write a Python function that checks whether a number is prime." -k 4 --max-tokens 48' \
 'specdec generate "def quicksort(xs):" --proposer ngram -k 3 --max-tokens 64' \
 'specdec generate "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 7 --stream --max-tokens 32' \
 'specdec generate "Once upon a time" --temperature 0.8 --min-p 0.05 --repetition-penalty 1.2 --logit-bias 13=-5 --max-tokens 32' \
 'specdec generate "def add(a, b):" --proposer none --max-tokens 16 --json' \
 'specdec generate --message "user:Write a prime check in Python." --proposer none --max-tokens 16 --json' \
 'specdec generate "hi" --max-tokens 100000000' \
 'specdec generate "hi" --target demo:draft --draft demo:target --max-tokens 4' \
 ; do echo "=== $cmd"; /usr/bin/time -f "%e s, maxrss %M KB" bash -c "$cmd" 2>&1 | grep -v '"logprob\|^      \|^    \]' | head -40; echo "rc=${PIPESTATUS[0]}"; done
date -u; cat /proc/loadavg
echo "=== README in-process python snippet"
/usr/bin/time -f "%e s" python - <<'PY'
from specdec.engine.engine import SpeculativeEngine
from specdec.models.loader import load_pair
from specdec.models.spec import ModelPairSpec, parse_model_spec
from specdec.request import GenerationRequest

target, draft = load_pair(ModelPairSpec(target=parse_model_spec("demo:target"), draft=parse_model_spec("demo:draft")))
engine = SpeculativeEngine(target, draft)       # the default weight format of this machine
result = engine.generate(GenerationRequest(prompt="def add(a, b):", max_tokens=32))
print(result.text, result.stats.acceptance_rate)
print("ids16", list(result.token_ids[:16]))
PY
date -u; cat /proc/loadavg

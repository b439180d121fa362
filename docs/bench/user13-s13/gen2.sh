cd /work/wt-user
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
date -u; cat /proc/loadavg
specdec generate "def add(a, b):" --proposer none --max-tokens 16 --json 2>/dev/null | python -c "import json,sys; d=json.load(sys.stdin); print('target alone ids', d['token_ids'], repr(d['text']))"
date -u; cat /proc/loadavg

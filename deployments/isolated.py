"""Run one function in a short-lived child Python process and bring its result back.

For work a replica does once, whose libraries would otherwise stay in the replica's memory for
its whole life: the router and target replicas hold no model, but reading the target's tokenizer
through transformers' ``AutoTokenizer`` (or building a model folder) imports torch and
transformers' model code, about 0.2-0.3 GiB of RSS that a process never gives back. In a child
process that memory is returned when the child exits; the result comes back pickled (a
tokenizer unpickles into its own class's module, which does not import torch).

The child is ``sys.executable -m deployments.isolated`` with this process's ``sys.path`` as its
``PYTHONPATH`` (so it imports what this process can), the same environment otherwise, and its
stderr joined to this process's (its logs land in the replica's log).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from typing import Any, Callable


def call_in_child(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
    """``fn(*args)`` computed in a child Python process.

    Args:
        fn: a module-level function (pickled by reference; so are classes of its arguments).
        args: picklable arguments.
        timeout_s: seconds before the child is killed (None: no limit).

    Returns:
        what ``fn`` returned (pickled there, unpickled here).

    Raises:
        whatever ``fn`` raised in the child (the exception object, pickled back);
        RuntimeError: the child died without an answer (its exit status; its stderr was
            already written to this process's stderr); subprocess.TimeoutExpired.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryDirectory(prefix="specdec-child-") as tmp:
        job, answer = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "answer.pkl")
        with open(job, "wb") as f:
            pickle.dump((fn, args), f)
        proc = subprocess.run([sys.executable, "-m", "deployments.isolated", job, answer], env=env,
                              stdin=subprocess.DEVNULL, stdout=2, timeout=timeout_s)
        if not os.path.exists(answer):
            raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} in a child process: it exited with status "
                               f"{proc.returncode} and no answer (its stderr is above)")
        with open(answer, "rb") as f:
            ok, value = pickle.load(f)
    if not ok:
        raise value
    return value


def _child(job: str, answer: str) -> None:
    with open(job, "rb") as f:
        fn, args = pickle.load(f)
    try:
        out = (True, fn(*args))
    except Exception as e:  # raised again in the parent
        out = (False, e)
    try:
        data = pickle.dumps(out)
    except Exception as e:  # an unpicklable result or exception
        data = pickle.dumps((False, RuntimeError(f"{fn.__qualname__} in a child process: {out[1]!r} ({e})")))
    with open(answer + ".tmp", "wb") as f:
        f.write(data)
    os.replace(answer + ".tmp", answer)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])

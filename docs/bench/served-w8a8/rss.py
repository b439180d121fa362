"""RSS of the model processes (Serve replicas, TP workers) below a process, and with a second
argument their OpenMP settings: ``python rss.py ROOT_PID [env]``."""
import subprocess
import sys

root = int(sys.argv[1])
rows = [l.split(None, 3) for l in subprocess.check_output(["ps", "-eo", "pid,ppid,rss,args"], text=True).splitlines()[1:]]
kids = {}
for pid, ppid, rss, args in rows:
    kids.setdefault(int(ppid), []).append((int(pid), int(rss), args))


def model_processes(root: int):
    """(pid, rss KiB, args) of every Serve replica or TP worker below ``root``."""
    stack = [root]
    while stack:
        for pid, rss, args in kids.get(stack.pop(), []):
            stack.append(pid)
            if "ServeReplica" in args or "TPWorker" in args:
                yield pid, rss, args


procs = list(model_processes(root))
print(f"{sum(r for _, r, _ in procs) / 1048576:.2f} GiB "
      f"({', '.join(f'{a.split()[0][:40]}={r / 1048576:.2f}' for _, r, a in procs)})")
if len(sys.argv) > 2:
    for pid, _, args in procs:
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        print(f"  {args.split()[0][:40]}: OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY')} OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}")

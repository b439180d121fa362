"""RSS of the model processes (Serve replicas, TP workers) below a process, and with a second
argument their OpenMP settings: ``python rss.py ROOT_PID [env]``.

Also their PSS (/proc/PID/smaps_rollup): RSS counts a page shared by several processes (the
torch and Python libraries' code every Ray worker maps) once per process; PSS divides it among
them, so the PSS sum is the memory the processes take together."""
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


def pss_kib(pid: int) -> int:
    """Proportional set size of ``pid`` in KiB (0 when unreadable)."""
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


procs = list(model_processes(root))
pss = sum(pss_kib(p) for p, _, _ in procs)
print(f"{sum(r for _, r, _ in procs) / 1048576:.2f} GiB "
      f"({', '.join(f'{a.split()[0][:40]}={r / 1048576:.2f}' for _, r, a in procs)}); "
      f"PSS {pss / 1048576:.2f} GiB = {pss * 1024 / 1e9:.2f} GB")
if len(sys.argv) > 2:
    for pid, _, args in procs:
        try:
            env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        try:
            status = {l.split(":")[0]: int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith(("RssAnon", "RssFile", "RssShmem"))}
        except OSError:
            status = {}
        print(f"  {args.split()[0][:40]}: OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY')} OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')} "
              f"PSS={pss_kib(pid) / 1048576:.2f} " + " ".join(f"{k}={v / 1048576:.2f}" for k, v in status.items()))

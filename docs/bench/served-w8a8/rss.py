import sys, subprocess
root = int(sys.argv[1])
rows = [l.split(None, 3) for l in subprocess.check_output(["ps", "-eo", "pid,ppid,rss,args"], text=True).splitlines()[1:]]
kids = {}
for pid, ppid, rss, args in rows:
    kids.setdefault(int(ppid), []).append((int(pid), int(rss), args))
tot = 0; out = []
stack = [root]
while stack:
    p = stack.pop()
    for pid, rss, args in kids.get(p, []):
        stack.append(pid)
        if "ServeReplica" in args or "TPWorker" in args:
            tot += rss; out.append(f"{args.split()[0][:40]}={rss/1048576:.2f}")
print(f"{tot/1048576:.2f} GiB ({', '.join(out)})")
if len(sys.argv) > 2:
    stack = [root]
    while stack:
        p = stack.pop()
        for pid, rss, args in kids.get(p, []):
            stack.append(pid)
            if "ServeReplica" in args or "TPWorker" in args:
                try:
                    env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ").read().split("\0") if "=" in kv)
                except OSError:
                    continue
                print(f"  {args.split()[0][:40]}: OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY')} OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}")

"""While a served run goes on, the model processes' memory by mapping kind: ``python watch_smaps.py
RAY_TMPDIR SECONDS``.

Every 10 s, for the `specdec serve` started with ``RAY_TMPDIR`` in its environment (a helper's own
run among others'), finds its Serve replicas and TP workers (as rss.py) and reads their
/proc/PID/smaps: RSS in [heap] (glibc's main arena), in anonymous mappings (other glibc arenas,
large malloc chunks, tensors, thread stacks), in the model files (safetensors, quantized.pt) and in
libraries. Prints the last sample taken while they were alive (and each one with ``-v``)."""
import os
import subprocess
import sys
import time


def serve_root(tmpdir: str) -> int | None:
    out = subprocess.run(["pgrep", "-f", "specdec serve"], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            env = open(f"/proc/{pid}/environ").read().split("\0")
        except OSError:
            continue
        if f"RAY_TMPDIR={tmpdir}" in env:
            return int(pid)
    return None


def model_processes(root: int):
    rows = [l.split(None, 2) for l in subprocess.check_output(["ps", "-eo", "pid,ppid,args"], text=True).splitlines()[1:]]
    kids: dict[int, list] = {}
    for pid, ppid, args in rows:
        kids.setdefault(int(ppid), []).append((int(pid), args))
    stack = [root]
    while stack:
        for pid, args in kids.get(stack.pop(), []):
            stack.append(pid)
            if "ServeReplica" in args or "TPWorker" in args:
                yield pid, args.split()[0]


def kinds(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    cur = None
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path == "[heap]":
                cur = "heap"
            elif not path or path.startswith("["):
                cur = "anon"
            elif path.endswith((".safetensors", "quantized.pt")):
                cur = os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)
            else:
                cur = "other files"
        elif head == "Rss:":
            out[cur] = out.get(cur, 0) + int(line.split()[1])
    return out


def main() -> None:
    tmpdir, seconds = sys.argv[1], float(sys.argv[2])
    verbose = "-v" in sys.argv
    last = None
    t0 = time.time()
    while time.time() - t0 < seconds:
        root = serve_root(tmpdir)
        sample = []
        if root is not None:
            for pid, name in model_processes(root):
                try:
                    sample.append((name, kinds(pid)))
                except OSError:
                    pass
        if sample:
            last = (time.strftime("%H:%M:%S", time.gmtime()), sample)
            if verbose:
                show(last)
        elif last is not None and root is None:
            break
        time.sleep(10)
    if last:
        show(last)


def show(last) -> None:
    stamp, sample = last
    print(f"-- model processes by mapping kind at {stamp} (MiB RSS)")
    for name, k in sample:
        print(f"   {name[:40]}: " + ", ".join(f"{n} {v / 1024:.0f}" for n, v in sorted(k.items(), key=lambda kv: -kv[1]) if v >= 1024))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Sample every process's CPU time, page faults and RSS every INTERVAL s (default 0.5) into a JSONL file
until killed: ``python cpu_sampler_s12.py OUT.jsonl [INTERVAL]``.

One line per sample: ``{"t": unix seconds, "load": loadavg 1 min, "cpu": /proc/stat's
cpu line (user nice system idle iowait irq softirq steal, 1/100 s), "vm": a few /proc/vmstat counters, "p": {pid: [name, cpu ticks (utime+stime,
1/100 s), minflt, majflt, rss pages, threads, network namespace inode]}}``; the name is the process title Ray sets (``ray::IDLE``,
``ray::ServeReplica:specdec:Draft``, ``ray::TPWorker``...) or the command line's first 80 characters.
``cpu_summary_s12.py`` turns it into per-process CPU per phase (ready, each request)."""
import json
import os
import sys
import time

out = open(sys.argv[1], "w")
interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
names: dict[int, str] = {}
netns: dict[int, str] = {}  # pid -> its network namespace's inode (which helper's netns it runs in)
VMSTAT = {"pgfault", "pgmajfault", "thp_fault_alloc", "thp_collapse_alloc", "pgfree", "pgsteal_direct", "pgsteal_kswapd",
          "pgscan_kswapd", "pgscan_direct", "compact_stall", "thp_fault_fallback"}
while True:
    t = time.time()
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        try:
            stat = open(f"/proc/{d}/stat").read()
            if pid not in names or names[pid].startswith(("?", "ray::")) or "python" in names[pid]:  # Ray renames its workers
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
                names[pid] = cmd[:80] or "?" + stat[stat.index("(") + 1:stat.rindex(")")]
                if pid not in netns:
                    netns[pid] = os.readlink(f"/proc/{d}/ns/net")[5:-1]
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        # f[0] is field 3 (state): minflt field 10, majflt 12, utime 14, stime 15, threads 20, rss 24
        procs[pid] = [names[pid], int(f[11]) + int(f[12]), int(f[7]), int(f[9]), int(f[21]), int(f[17]), netns.get(pid, "")]
    cpu = [int(x) for x in open("/proc/stat").readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    vm = {k: int(v) for k, v in (l.split() for l in open("/proc/vmstat")) if k in VMSTAT}
    out.write(json.dumps({"t": round(t, 3), "load": float(open("/proc/loadavg").read().split()[0]), "cpu": cpu, "vm": vm,
                          "p": procs}) + "\n")
    out.flush()
    time.sleep(max(0.0, interval - (time.time() - t)))

"""Print the file-vs-fio table from `tiercache bench ... --output-format json` files:
python3 tools/fio-table.py host-file.json device-file.json"""
import json
import sys

print(f"{'job':<22}{'tiers':<13}{'tiercache GB/s':>15}{'fio GB/s':>10}{'ratio':>7}{'range':>12}"
      f"{'durable fio':>12}{'ratio':>7}{'p99 us tc/fio':>16}")
for path in sys.argv[1:]:
    for r in json.load(open(path))["jobs"]:
        tc = r["tiercache"]
        op = "read" if r["read"]["total_ios"] >= r["write"]["total_ios"] else "write"
        b, d = tc.get("baseline", {}), tc.get("baseline_durable", {})
        rng = b.get("ratio_range", [b.get("ratio", 0)] * 2)
        print(f"{r['jobname']:<22}{tc['tiers']:<13}{r[op]['bw_bytes'] / 1e9:>15.2f}{b.get('bw_bytes', 0) / 1e9:>10.2f}"
              f"{b.get('ratio', 0):>7.2f}{f'{rng[0]:.2f}-{rng[1]:.2f}':>12}"
              f"{d.get('bw_bytes', 0) / 1e9:>12.2f}{d.get('ratio', 0):>7.2f}"
              f"{b.get('tiercache_clat_p99_ns', 0) / 1e3:>9.0f}/{b.get('clat_p99_ns', 0) / 1e3:.0f}")

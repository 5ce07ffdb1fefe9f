# SPDX-License-Identifier: Apache-2.0
"""Turns a fetched benchmark result into a record and regenerates docs/performance.md.

Usage (here, after fetching OUTDIR from the GPU machine, whose files do not persist):
  python3 bench/record.py OUTDIR/bench.json --name dense-sm90 [--commit SHA]
writes bench/records/<date>-<gpu>-<name>.json (the data) and .md (date, commit, GPU, command,
tables), then runs make_performance_md.py. The commit is the one bench.json carries (SP_COMMIT
on the GPU machine) unless --commit is given; a record without one is refused. --feeds TITLE
(repeatable) limits the docs/performance.md tables the record feeds: a run of a few rows for one
change (an A/B side) would otherwise replace other tables' rows with rows that lack their peers.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report  # noqa: E402
import make_performance_md  # noqa: E402


def gpu_slug(name):
    """'NVIDIA H200' -> 'h200'."""
    last = (name or "gpu").split()[-1]
    return re.sub(r"[^a-z0-9]+", "-", last.lower()).strip("-") or "gpu"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_json")
    ap.add_argument("--name", required=True, help="short slug: what this run measures")
    ap.add_argument("--commit", help="the commit the GPU machine's working tree came from")
    ap.add_argument("--force", action="store_true", help="overwrite a record of the same name")
    ap.add_argument("--feeds", action="append", metavar="TITLE",
                    help="a docs/performance.md table (its title) this record feeds; default every table")
    args = ap.parse_args()
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", args.name):
        sys.exit("record: --name: expected lowercase letters, digits and '-'")
    with open(args.bench_json) as f:
        result = json.load(f)
    if args.commit:
        result["commit"] = args.commit
    if args.feeds:
        titles = [claim["title"] for claim in make_performance_md.CLAIMS]
        unknown = [t for t in args.feeds if t not in titles]
        if unknown:
            sys.exit(f"record: --feeds {unknown[0]!r}: not a table of docs/performance.md ({'; '.join(titles)})")
        result["feeds"] = args.feeds
    if not result.get("commit") or result["commit"] == "unknown":
        sys.exit("record: the result carries no commit; pass --commit SHA")
    base = f"{result['date'][:10]}-{gpu_slug(result['env'].get('gpu'))}-{args.name}"
    json_path = os.path.join(make_performance_md.RECORDS, base + ".json")
    md_path = os.path.join(make_performance_md.RECORDS, base + ".md")
    if os.path.exists(json_path) and not args.force:
        sys.exit(f"record: {json_path} exists (pass --force to replace it)")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    header = [f"# {base}", "",
              f"Data: [{base}.json]({base}.json). Method: `bench/README.md` (also in the data, "
              "key `method`).", "", ""]
    with open(md_path, "w") as f:
        f.write("\n".join(header) + bench_report.render(result) + "\n")
    print(f"record: wrote {md_path}")
    make_performance_md.main()


if __name__ == "__main__":
    main()

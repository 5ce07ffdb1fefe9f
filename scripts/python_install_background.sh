#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: scripts/python_install_cuda.sh in the background, so that the package builds while
# later device calls carry their parts (shared by scripts/model/assemble_qwen.sh and
# scripts/vllm/). DIR lies outside the repository's copy, which each call replaces: DIR/src (the
# copy of the tree it builds from), DIR/install.log, DIR/out.log and DIR/rc (its exit status,
# written when it ends).
#   python_install_background.sh start DIR           start the build (from scratch)
#   python_install_background.sh wait DIR SECONDS    wait at most SECONDS for it; exit status 1,
#                                                    with the logs' tails, unless it succeeded
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${2:?usage: python_install_background.sh start DIR | wait DIR SECONDS}
case "$1" in
  start)
    rm -rf "$dir" && mkdir -p "$dir/src"
    (cd "$root" && tar --exclude=./.carry --exclude=./build -cf - .) | tar -xf - -C "$dir/src"
    (cd "$dir/src" && setsid nohup bash -c "scripts/python_install_cuda.sh '$dir'; echo \$? >'$dir/rc'" \
      >"$dir/out.log" 2>&1 </dev/null &)
    ;;
  wait)
    seconds=${3:?usage: python_install_background.sh wait DIR SECONDS}
    for _ in $(seq 1 "$seconds"); do [ -f "$dir/rc" ] && break; sleep 1; done
    if [ "$(cat "$dir/rc" 2>/dev/null)" != 0 ]; then
      tail -n 30 "$dir/install.log" "$dir/out.log" 2>/dev/null || true
      echo "python_install_background: the build in $dir failed or did not finish within $seconds s" >&2
      exit 1
    fi
    tail -n 1 "$dir/out.log"
    ;;
  *)
    echo "usage: python_install_background.sh start DIR | wait DIR SECONDS" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# N replicas of mlx-cache-server behind sglang-router's cache-aware policy, in one command:
#
#   configs/replicas.sh [N] [PORT] [-- serve flags...]
#   configs/replicas.sh 2 8080 -- --model mlx-community/Qwen3-4B-4bit --cache-max-bytes 4GiB
#
# Clients use http://127.0.0.1:PORT/v1 as they would one server. The replicas listen on
# PORT+1..PORT+N (loopback); the router sends each conversation to the replica whose cache
# holds its prefix and spreads new conversations by load. Needs the router extra:
#   pip install -c requirements.lock -e ".[router]"
# Replicas on other machines: start `mlx-cache-server serve --host 0.0.0.0 --api-key ...` on
# each, then only the router: python -m sglang_router.launch_router --worker-urls URL...
# with the flags below. Ctrl-C stops the router and the replicas.
set -euo pipefail
N=${1:-2}
PORT=${2:-8080}
shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT INT TERM
URLS=()
for i in $(seq 1 "$N"); do
  mlx-cache-server serve --port $((PORT + i)) "$@" &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$((PORT + i))")
done
for url in "${URLS[@]}"; do  # each replica loads its model before the router sends it work
  until curl -sf "$url/health" >/dev/null; do sleep 1; done
done
# Balance as soon as the replicas' loads differ: the router's own thresholds (64 requests)
# would send every conversation sharing a system prompt to one replica.
python -m sglang_router.launch_router --host 127.0.0.1 --port "$PORT" \
  --policy cache_aware --balance-abs-threshold 1 --balance-rel-threshold 1.1 \
  --worker-urls "${URLS[@]}" &
PIDS+=($!)
wait -n "${PIDS[@]}"

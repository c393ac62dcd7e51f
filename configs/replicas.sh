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
# Each replica gets the same serve flags: give them no --cache-dir (each disk tier needs a
# folder of its own), or start them yourself. Replicas on other machines: start
# `mlx-cache-server serve --host 0.0.0.0 --api-key ...` on each, then only the router:
# python -m sglang_router.launch_router --worker-urls URL... with the flags below.
# Ctrl-C stops the router and the replicas. Runs with macOS's bash 3.2 too.
set -euo pipefail
N=2
PORT=8080
if [ $# -gt 0 ] && [ "$1" != "--" ]; then N=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then PORT=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT INT TERM
URLS=()
for i in $(seq 1 "$N"); do
  mlx-cache-server serve --port $((PORT + i)) "$@" &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$((PORT + i))")
done
for i in $(seq 0 $((N - 1))); do  # each replica loads its model before the router sends work
  until curl -sf "${URLS[$i]}/health" >/dev/null; do
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "replica ${URLS[$i]} did not start" >&2; exit 1; }
    sleep 1
  done
done
# --balance-*: balance as soon as the replicas' loads differ (the router's default, 64
# requests, sends every conversation sharing a system prompt to one replica).
# --cache-threshold: follow a conversation even when its new turn is most of its text (a
# short question, a long answer: the router's default, 0.3, would route it by load).
python -m sglang_router.launch_router --host 127.0.0.1 --port "$PORT" \
  --policy cache_aware --balance-abs-threshold 1 --balance-rel-threshold 1.1 \
  --cache-threshold 0.05 --worker-urls "${URLS[@]}" &
PIDS+=($!)
while :; do  # until any of them ends (kill -0 of them all succeeds while one lives)
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || exit 1; done
  sleep 1
done

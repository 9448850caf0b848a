#!/usr/bin/env bash
# A bandwidth-shaped testbed on one machine: member i lives in network namespace rvn-m<i> with the
# address 10.77.0.<i+1>/24 on its eth0, a veth whose other end is plugged into a bridge in namespace
# rvn-hub. Each member's link is shaped with tbf in both directions: its upload on its own eth0, its
# download on the hub end (netem is not available everywhere; tbf is). The hub itself is 10.77.0.254
# (scripts/testbed.py runs the coordinator there). Needs root, ip and tc.
# Only touches namespaces named rvn-*; nothing in the host's own network namespace changes.
#
#   deploy/testbed/netns.sh up 50 200 200 200    # 4 members, member 0 at 50 Mbit/s, the rest at 200
#   ip netns exec rvn-m0 <command>                # run something as member 0
#   deploy/testbed/netns.sh down                  # delete every rvn-* namespace (and so every veth)
set -euo pipefail
PREFIX=rvn-
HUB=${PREFIX}hub
SUBNET=10.77.0

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}" || true); do
    ip netns del "$ns"
  done
}

shape() {  # namespace device rate_mbit
  # burst above the largest GSO packet a veth hands over (64 KiB); a short queue (20 ms by default)
  # keeps the ACKs of one direction from waiting behind a long queue of data in the other
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "${3}mbit" burst 128kb latency "${TBF_LATENCY:-20ms}"
}

up() {
  [ $# -ge 2 ] || { echo "usage: $0 up RATE_MBIT RATE_MBIT [...]" >&2; exit 2; }
  down
  trap 'down; exit 1' ERR
  ip netns add "$HUB"
  ip -n "$HUB" link set lo up  # a process here reaching the hub's own address goes through lo
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 up
  ip -n "$HUB" addr add "$SUBNET.254/24" dev br0  # the hub's own address, unshaped: a coordinator's
  local i=0
  for rate in "$@"; do
    local ns=${PREFIX}m$i
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "port$i" netns "$HUB" type veth peer name eth0 netns "$ns"
    ip -n "$HUB" link set "port$i" master br0 up
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    shape "$ns" eth0 "$rate"      # member -> bridge: its upload
    shape "$HUB" "port$i" "$rate" # bridge -> member: its download
    i=$((i + 1))
  done
  trap - ERR
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  *) echo "usage: $0 up RATE_MBIT RATE_MBIT [...] | down" >&2; exit 2 ;;
esac

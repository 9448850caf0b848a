#!/usr/bin/env bash
# A bandwidth-shaped testbed on one machine: member i lives in network namespace rvn-m<i> with the
# address 10.77.0.<i+1>/24 on its eth0, a veth whose other end is plugged into a bridge in namespace
# rvn-hub. Each member's link is shaped with tbf in both directions: its upload on its own eth0, its
# download on the hub end (netem is not available everywhere; tbf is). The hub itself is 10.77.0.254
# (scripts/testbed.py runs the coordinator there). Needs root, ip and tc.
# Only touches namespaces named rvn-*; nothing in the host's own network namespace changes.
#
# A member whose rate ends in ":nat" is a volunteer at home: it sits behind a router of its own,
# namespace rvn-r<i>, which holds 10.77.0.<i+1> on the bridge and masquerades (iptables NAT) the
# member's private 192.168.<i>.2 behind it. Nothing from outside can open a connection to it: the
# router forwards only replies (conntrack ESTABLISHED), and the member drops every new inbound
# connection itself. Its link is shaped the same way, between the router and the bridge.
#
#   deploy/testbed/netns.sh up 50 200 200 200    # 4 members, member 0 at 50 Mbit/s, the rest at 200
#   deploy/testbed/netns.sh up 100 100:nat 100 100:nat   # members 1 and 3 behind NAT
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
  [ $# -ge 2 ] || { echo "usage: $0 up RATE_MBIT[:nat] RATE_MBIT[:nat] [...]" >&2; exit 2; }
  down
  trap 'down; exit 1' ERR
  ip netns add "$HUB"
  ip -n "$HUB" link set lo up  # a process here reaching the hub's own address goes through lo
  ip -n "$HUB" link add br0 type bridge
  ip -n "$HUB" link set br0 up
  ip -n "$HUB" addr add "$SUBNET.254/24" dev br0  # the hub's own address, unshaped: a coordinator's
  local i=0
  for member in "$@"; do
    local ns=${PREFIX}m$i rate=${member%:nat}
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # on the bridge: the member itself, or its router
    local public=$ns
    [ "$member" = "$rate" ] || public=${PREFIX}r$i
    [ "$public" = "$ns" ] || { ip netns add "$public"; ip -n "$public" link set lo up; }
    ip link add "port$i" netns "$HUB" type veth peer name eth0 netns "$public"
    ip -n "$HUB" link set "port$i" master br0 up
    ip -n "$public" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$public" link set eth0 up
    shape "$public" eth0 "$rate"  # member -> bridge: its upload
    shape "$HUB" "port$i" "$rate" # bridge -> member: its download
    [ "$public" = "$ns" ] || nat "$public" "$ns" "$i"
    i=$((i + 1))
  done
  trap - ERR
}

nat() {  # router member i: the member at 192.168.<i>.2 behind the router's masquerade
  local router=$1 ns=$2 lan=192.168.$3
  ip link add eth1 netns "$router" type veth peer name eth0 netns "$ns"
  ip -n "$router" addr add "$lan.1/24" dev eth1
  ip -n "$router" link set eth1 up
  ip -n "$ns" addr add "$lan.2/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$lan.1"
  ip netns exec "$router" sysctl -qw net.ipv4.ip_forward=1
  ip netns exec "$router" iptables -t nat -A POSTROUTING -o eth0 -j MASQUERADE
  ip netns exec "$router" iptables -A FORWARD -i eth0 -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
  ip netns exec "$router" iptables -A FORWARD -i eth0 -j DROP
  ip netns exec "$router" iptables -A INPUT -i eth0 -m conntrack --ctstate NEW -j DROP
  ip netns exec "$ns" iptables -A INPUT -i eth0 -m conntrack --ctstate NEW -j DROP
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  *) echo "usage: $0 up RATE_MBIT[:nat] RATE_MBIT[:nat] [...] | down" >&2; exit 2 ;;
esac

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
# A member with ",rtt=MS" (and ",jitter=MS", ",loss=P") reaches the bridge through a line of its own,
# namespace rvn-d<i>: two bridges joined by deploy/testbed/linedelay.py, which holds every frame for
# half the round trip each way (+- half the jitter; each frame lost with probability P). A round trip
# between two members is the sum of their lines' (the hub's own address has none). Bandwidth is shaped
# as before, on the member's (or router's) eth0 and on the hub's port.
#
#   deploy/testbed/netns.sh up 50 200 200 200    # 4 members, member 0 at 50 Mbit/s, the rest at 200
#   deploy/testbed/netns.sh up 100 100:nat 100 100:nat   # members 1 and 3 behind NAT
#   deploy/testbed/netns.sh up 100,rtt=100,jitter=10 100,rtt=50:nat   # 100 ms +- 10 to the hub; 50 ms
#   deploy/testbed/netns.sh line 0 200 20 0.01    # change member 0's line: rtt 200 ms, jitter 20, loss 1%
#   deploy/testbed/netns.sh rate 0 25             # change member 0's bandwidth (both ways) to 25 Mbit/s
#   ip netns exec rvn-m0 <command>                # run something as member 0
#   deploy/testbed/netns.sh down                  # delete every rvn-* namespace (and so every veth)
set -euo pipefail
PREFIX=rvn-
HUB=${PREFIX}hub
SUBNET=10.77.0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RUN=${RVN_TESTBED_RUN:-/run/ravnest-testbed}  # the line emulators' pid, settings and stats files

down() {
  for pidfile in "$RUN"/d*.pid; do
    [ -e "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
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
    local ns=${PREFIX}m$i link=${member%:nat}
    local rate=${link%%,*} rtt= jitter=0 loss=0 option
    for option in $(tr ',' ' ' <<< "${link#"$rate"}"); do
      case "$option" in
        rtt=*) rtt=${option#rtt=} ;;
        jitter=*) jitter=${option#jitter=} ;;
        loss=*) loss=${option#loss=} ;;
        *) echo "$0: member $i: unknown option '$option' (rtt=MS, jitter=MS, loss=P)" >&2; exit 2 ;;
      esac
    done
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # on the bridge: the member itself, or its router
    local public=$ns
    [ "$member" = "$link" ] || public=${PREFIX}r$i
    [ "$public" = "$ns" ] || { ip netns add "$public"; ip -n "$public" link set lo up; }
    if [ -n "$rtt" ] || [ "$jitter$loss" != 00 ]; then
      line "$i" "$public" "${rtt:-0}" "$jitter" "$loss"
    else
      ip link add "port$i" netns "$HUB" type veth peer name eth0 netns "$public"
    fi
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

line() {  # member i's line: hub port -> rvn-d<i> (bridge wan, tap tw) ~ delay ~ (tap tl, bridge lan) -> public
  local i=$1 public=$2 d=${PREFIX}d$1
  ip netns add "$d"
  ip link add "port$i" netns "$HUB" type veth peer name wan0 netns "$d"
  ip link add lan0 netns "$d" type veth peer name eth0 netns "$public"
  local side
  for side in wan lan; do
    ip -n "$d" link add "$side" type bridge
    ip -n "$d" tuntap add dev "t${side:0:1}" mode tap
    ip -n "$d" link set "t${side:0:1}" master "$side" up
    ip -n "$d" link set "${side}0" master "$side" up
    ip -n "$d" link set "$side" up
  done
  mkdir -p "$RUN"
  echo "$3 $4 $5" > "$RUN/d$i.settings"
  rm -f "$RUN/d$i.pid"
  ip netns exec "$d" setsid "${PYTHON:-python3}" "$HERE/linedelay.py" --rtt-ms "$3" --jitter-ms "$4" --loss "$5" \
    --seed "$i" --settings "$RUN/d$i.settings" --pidfile "$RUN/d$i.pid" --stats "$RUN/d$i.stats" \
    < /dev/null >> "$RUN/d$i.log" 2>&1 &
  local tries=0
  until [ -s "$RUN/d$i.pid" ]; do  # its taps are open once it has written its pid
    tries=$((tries + 1))
    [ $tries -le 100 ] || { echo "$0: member $i's line did not start: $(cat "$RUN/d$i.log")" >&2; return 1; }
    sleep 0.05
  done
}

set_line() {  # i rtt_ms jitter_ms loss: change a running line
  [ -s "$RUN/d$1.pid" ] || { echo "$0: member $1 has no line (bring it up with ,rtt=MS)" >&2; exit 2; }
  echo "$2 $3 $4" > "$RUN/d$1.settings"
  kill -HUP "$(cat "$RUN/d$1.pid")"
}

set_rate() {  # i rate_mbit: both ways
  local public=${PREFIX}m$1
  ip netns list | grep -q "^${PREFIX}r$1\b" && public=${PREFIX}r$1
  shape "$public" eth0 "$2"
  shape "$HUB" "port$1" "$2"
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
  line) [ $# -eq 5 ] || { echo "usage: $0 line MEMBER RTT_MS JITTER_MS LOSS" >&2; exit 2; }; set_line "$2" "$3" "$4" "$5" ;;
  rate) [ $# -eq 3 ] || { echo "usage: $0 rate MEMBER RATE_MBIT" >&2; exit 2; }; set_rate "$2" "$3" ;;
  *) echo "usage: $0 up RATE_MBIT[,rtt=MS][,jitter=MS][,loss=P][:nat] [...] | line MEMBER RTT JITTER LOSS" \
          "| rate MEMBER MBIT | down" >&2; exit 2 ;;
esac

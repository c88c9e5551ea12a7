#!/bin/sh
# A region's uplink: forwards between the region's network and the wide-area network, shapes what
# leaves the region to UPLINK_MBIT (token bucket, as tests/network does for its islands), and
# routes each other region's subnet via that region's gateway. Traffic inside a region never
# passes here, so it stays at LAN speed.
#   REGION  this region's number n: its subnet is 10.77.n.0/24, its wan address 10.77.0.(10+n)
#   REGIONS all region numbers, e.g. "1 2 3"
set -eu
wan_address="10.77.0.$((10 + REGION))"
wan=$(ip -o -4 addr show | awk -v a="$wan_address" '$4 ~ "^"a"/" {print $2}')
[ -n "$wan" ] || { echo "gateway: no interface holds $wan_address" >&2; exit 1; }
tc qdisc replace dev "$wan" root tbf rate "${UPLINK_MBIT}mbit" burst 32kb latency 200ms
for other in $REGIONS; do
    [ "$other" = "$REGION" ] || ip route replace "10.77.$other.0/24" via "10.77.0.$((10 + other))"
done
echo "gateway: region $REGION egress on $wan shaped to ${UPLINK_MBIT} Mbit/s"
# nothing else to do: the kernel forwards; stop at once on docker stop
trap 'exit 0' TERM INT
while :; do sleep 3600 & wait $!; done

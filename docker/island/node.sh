#!/bin/sh
# Starts one island node. Runs as root only to route the other regions via this region's gateway,
# then runs diloco-node as the unprivileged user `diloco` with no capabilities left.
#   ADDRESS   this node's fixed address (announced to peers)
#   GATEWAY   this region's gateway
#   BOOTSTRAP 1 on the node the others join first; it publishes its address in /bootstrap
set -eu
ip route replace 10.77.0.0/16 via "$GATEWAY"
export HOME=/home/diloco
unprivileged="setpriv --reuid=diloco --regid=diloco --init-groups --inh-caps=-all --bounding-set=-all"
listen="/ip4/0.0.0.0/tcp/31337"
announce="/ip4/$ADDRESS/tcp/31337"
if [ "${BOOTSTRAP:-0}" = 1 ]; then
    # the key lives in this node's volume, so its peer id and address survive restarts
    peer_id=$($unprivileged diloco-node identity /data/checkpoints/identity.key)
    echo "$announce/p2p/$peer_id" > /bootstrap/address.tmp
    mv /bootstrap/address.tmp /bootstrap/address
else
    waited=0
    until [ -s /bootstrap/address ]; do
        [ $waited -lt 120 ] || { echo "node: no bootstrap address after 120 s" >&2; exit 1; }
        sleep 1; waited=$((waited + 1))
    done
    set -- --peer "$(cat /bootstrap/address)" "$@"
fi
exec $unprivileged diloco-node join --listen "$listen" --announce "$announce" "$@"

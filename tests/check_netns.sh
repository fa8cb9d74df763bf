#!/bin/sh
# SPDX-License-Identifier: MIT
# Two "nodes" on one machine: network namespaces joined by a veth pair, with
# addresses that exist inside them only (no loopback shortcut). cparrun runs
# one rank in each (--nnodes 2), and store_prog does the rendezvous across
# them: the store on node 0's address, the join, an all-to-all of 128-byte
# blobs, barriers. Needs root and iproute2 (ip netns); where namespaces
# cannot be made it says so in one line and passes.
# Usage: tests/check_netns.sh BUILD_DIR
set -u
B=${1:-build}
a=cparA$$ b=cparB$$ va=cva$$ vb=cvb$$
logs=$(mktemp -d)
cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; rm -rf "$logs"; }
trap cleanup EXIT
if ! ip netns add "$a" 2>/dev/null; then
    echo "netns: skipped: cannot create network namespaces here (needs root and iproute2)"
    exit 0
fi
set -e
ip netns add "$b"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$a"
ip link set "$vb" netns "$b"
ip -n "$a" addr add 10.77.$(($$ % 200)).1/24 dev "$va"
ip -n "$b" addr add 10.77.$(($$ % 200)).2/24 dev "$vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "$va" up
ip -n "$b" link set "$vb" up
set +e
master=10.77.$(($$ % 200)).1 port=$((20000 + $$ % 20000))
export CPAR_JOB_TOKEN="netns-$$-$(date +%s)" CPAR_TIMEOUT_MS=20000
ip netns exec "$a" "$B/cparrun" --nnodes 2 --node-rank 0 --master-addr "$master" --master-port "$port" -n 1 \
    "$B/host/store_prog" ok > "$logs/0" 2>&1 &
p0=$!
ip netns exec "$b" "$B/cparrun" --nnodes 2 --node-rank 1 --master-addr "$master" --master-port "$port" -n 1 \
    "$B/host/store_prog" ok > "$logs/1" 2>&1
s1=$?
wait $p0
s0=$?
if [ $s0 -ne 0 ] || [ $s1 -ne 0 ]; then
    echo "netns: the two-node rendezvous failed (node 0: status $s0, node 1: status $s1)"
    sed 's/^/node 0: /' "$logs/0"
    sed 's/^/node 1: /' "$logs/1"
    exit 1
fi
echo "netns: two nodes (network namespaces over a veth pair, store on $master:$port) joined and exchanged"

#!/bin/sh
# An ssh stand-in for MPI launchers on one machine: `netns_exec.sh [-x ...] HOST COMMAND...`
# runs COMMAND, a shell command line as ssh would hand it to the remote shell, in the network
# namespace that holds HOST's IPv4 address. scripts/cpu_compare.sh gives it to MPICH's hydra
# (-launcher ssh -launcher-exec) and Open MPI's mpirun (--mca plm_rsh_agent), so they start
# their proxies, and through them the ranks, in the namespaces it made: a hostfile alone would
# need sshd in each namespace.
while [ "${1#-}" != "$1" ]; do shift; done # ssh's options (hydra passes -x)
host=$1
shift
for ns in $(ip netns list | cut -d' ' -f1); do
  if ip -n "$ns" -o -4 addr show | grep -q " inet $host/"; then
    exec ip netns exec "$ns" sh -c "$*"
  fi
done
echo "netns_exec.sh: no network namespace holds $host" >&2
exit 1

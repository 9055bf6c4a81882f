#!/usr/bin/env bash
# The standard CPU comparison: ferrocomm-bench against MPICH and Open MPI (one C harness,
# benches/peers/mpi_bench.c, built against each) and Gloo (PyTorch, benches/peers/gloo_bench.py)
# for every collective the bench compares, at 2 and 4 processes, over three transports:
#
#   shm           ranks on this host as each library runs them by default: shared memory for
#                 ferrocomm, MPICH and Open MPI (Gloo has no shared-memory transport: it runs
#                 only in the TCP rows)
#   tcp-loopback  every link TCP over lo
#   tcp-veth      every link TCP, half the ranks in each of two network namespaces joined by a
#                 veth pair shaped like a network link (needs root; skipped otherwise)
#
# Each repetition runs every tool of a transport back to back for one op and world size, so
# the report can pair them. Installs what it needs (Debian's mpich and openmpi; torch from PyPI
# into .toolchain-cache/gloo-venv), writes JSON and logs under target/compare/, then the
# collectives section of docs/results/cpu.md and one plot per transport beside it.
#
#   scripts/cpu_compare.sh            the full run (about 40 minutes on 2 cores)
#   scripts/cpu_compare.sh --quick    a few sizes, one repetition: a smoke test of minutes that
#                                     writes its report to target/compare/ and leaves docs/ alone
#   --reps N                          repetitions (default 3; --quick: 1)
#   --ops "broadcast send_recv"       only these ops, at every size: a partial run, which also
#                                     writes its report to target/compare/ and leaves docs/ alone
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0 reps= only=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --reps) reps=${2:?--reps needs a number}; shift ;;
    --ops) only=${2:?--ops needs a list of ops}; shift ;;
    *) echo "usage: $0 [--quick] [--reps N] [--ops \"OP ...\"]" >&2; exit 2 ;;
  esac
  shift
done
reps=${reps:-$((quick ? 1 : 3))}
cache=.toolchain-cache
out=target/compare
rm -rf "$out" # stale runs must not mix with this one
mkdir -p "$cache" "$out/logs" target/peers

# --- tools -------------------------------------------------------------------------------------
# Both MPIs side by side: Debian's alternatives point `mpicc` and `mpiexec` at one of them, so
# every call below names its implementation.
missing=()
command -v mpicc.mpich >/dev/null || missing+=(mpich libmpich-dev)
command -v mpicc.openmpi >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
if [ ! -x "$cache/gloo-venv/bin/torchrun" ]; then
  python3 -m venv "$cache/gloo-venv"
  "$cache/gloo-venv/bin/pip" install -q torch numpy
fi
py="$cache/gloo-venv/bin/python"
torchrun="$cache/gloo-venv/bin/torchrun"
cargo build --release --quiet -p ferrocomm-bench
cargo build --release --quiet --bin ferrocomm-run
bench=${CARGO_TARGET_DIR:-target}/release/ferrocomm-bench
launcher=${CARGO_TARGET_DIR:-target}/release/ferrocomm-run
mpicc.mpich -O2 -Wall -o target/peers/mpi_bench_mpich benches/peers/mpi_bench.c
mpicc.openmpi -O2 -Wall -o target/peers/mpi_bench_openmpi benches/peers/mpi_bench.c
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Cores before OMP_NUM_THREADS is set: GNU nproc honours that variable.
cores=$(nproc)
export OMP_NUM_THREADS=1

# --- the two "hosts" ---------------------------------------------------------------------------
transports=(shm tcp-loopback)
notes=$out/notes.txt # what the report says about how each tool ran, one "transport|tool|text" per line
: >"$notes"
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null; then
  nsa=fcc-a-$$ nsb=fcc-b-$$ veth_a=fcca$$ veth_b=fccb$$
  # Namespaces of an earlier run that was killed hold the same addresses: netns_exec.sh must
  # not find those.
  for ns in $(ip netns list | grep -o '^fcc-[ab]-[0-9]*' || true); do
    kill -0 "${ns##*-}" 2>/dev/null || ip netns del "$ns"
  done
  addr_a=10.77.0.1 addr_b=10.77.0.2
  cleanup() {
    for ns in "$nsa" "$nsb"; do
      # Whatever a failed run left in the namespace was started by this script.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    done
  }
  trap cleanup EXIT
  ip netns add "$nsa"
  ip netns add "$nsb"
  ip link add "$veth_a" type veth peer name "$veth_b"
  ip link set "$veth_a" netns "$nsa"
  ip link set "$veth_b" netns "$nsb"
  ip -n "$nsa" addr add "$addr_a/24" dev "$veth_a"
  ip -n "$nsb" addr add "$addr_b/24" dev "$veth_b"
  for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
  ip -n "$nsa" link set "$veth_a" up
  ip -n "$nsb" link set "$veth_b" up
  # A 10 Gbit/s link with 50 us one way (netem); kernels built without netem get the rate
  # alone (tbf), and the report says which.
  shaped=
  for dev in "$nsa:$veth_a" "$nsb:$veth_b"; do
    if tc -n "${dev%%:*}" qdisc add dev "${dev#*:}" root netem delay 50us rate 10gbit 2>/dev/null; then
      shaped="tc qdisc add dev VETH root netem delay 50us rate 10gbit (each direction)"
    else
      tc -n "${dev%%:*}" qdisc add dev "${dev#*:}" root tbf rate 10gbit burst 1mb latency 5ms
      shaped="tc qdisc add dev VETH root tbf rate 10gbit burst 1mb latency 5ms (each direction; this kernel has no netem, so no added delay)"
    fi
  done
  echo "tcp-veth|link|$addr_a and $addr_b, one network namespace each, joined by a veth pair: $shaped" >>"$notes"
  transports+=(tcp-veth)
else
  echo "tcp-veth|all|not run: network namespaces need root, ip and tc" >>"$notes"
fi
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n') # ferrocomm-run's job secret across the namespaces
port=29700 # a fresh port per job across the namespaces: no TIME_WAIT clashes
limit=(timeout 600) # per launch: a hung rank must not stall the whole run
agent=$PWD/scripts/netns_exec.sh

# --- how each tool runs ------------------------------------------------------------------------
# Each takes: transport, world size, op, JSON path, sweeps ("lo:hi:factor:iters:warmup" ...).
# Across the namespaces, every tool numbers its ranks node by node: ranks 0..n/2-1 in the
# first namespace, so a ring crosses the link twice whichever tool runs it.

# `two_hosts COMMAND_B... \; COMMAND_A...` runs both at once (each in its namespace, by
# `ip netns exec` in the commands); fails if either does, and then stops the other, which may
# be waiting for its peer.
two_hosts() {
  local b=() peer
  while [ "$1" != ";" ]; do b+=("$1"); shift; done
  shift
  "${limit[@]}" "${b[@]}" &
  peer=$!
  if ! "${limit[@]}" "$@"; then
    kill "$peer" 2>/dev/null || true
    wait "$peer" || true
    return 1
  fi
  wait "$peer"
}

# With no more ranks than cores, every tool runs one rank per core on one host, as Open MPI
# does by default (unbound, two ranks may share a core for a whole run: 8-byte send/recv over
# TCP took 3.4-4.0 us bound and up to 11.9 us unbound). Across the namespaces ferrocomm-run
# and hydra would bind each namespace's ranks to the same first cores, so there none binds.
bind_ferrocomm() { [ "$1" -le "$cores" ] && echo --bind-to core || true; }
# Every tool settles before its first size (ferrocomm-bench --settle-ms, mpi_bench and
# gloo_bench.py --settle-ms=): small all_reduces until rank 0 has seen this long pass. With more
# ranks than cores the scheduler may start three ranks on one core and take 100-200 ms to spread
# them (docs/results/cpu.md, "Ranks placed three to one"); sizes timed meanwhile measured that.
settle_ms() { [ "$1" -gt "$cores" ] && echo 1000 || echo 300; }
bind_mpich() { [ "$1" -le "$cores" ] && echo -bind-to core || true; }

run_ferrocomm() {
  local t=$1 n=$2 op=$3 json=$4 s lo hi f it wu
  shift 4
  local bind
  read -ra bind <<<"$(bind_ferrocomm "$n")"
  # The bench takes one sweep per launch: one launch per sweep, JSON merged by the report.
  for s in "$@"; do
    IFS=: read -r lo hi f it wu <<<"$s"
    local args=("$op" -b "$lo" -e "$hi" -f "$f" -n "$it" -w "$wu" --settle-ms "$(settle_ms "$n")")
    local file=${json%.json}-$lo.json
    case $t in
      shm) "${limit[@]}" "$bench" "${args[@]}" --world "$n" "${bind[@]}" --json "$file" || return ;;
      tcp-loopback)
        FERROCOMM_TRANSPORT=tcp "${limit[@]}" "$bench" "${args[@]}" --world "$n" "${bind[@]}" --json "$file" || return
        ;;
      tcp-veth)
        port=$((port + 1))
        # The peers do not encrypt, so neither does ferrocomm here: its default seals links
        # between machines, and the namespaces count as machines (scripts/encrypt_cost.sh
        # measures what sealing costs).
        local run=(env FERROCOMM_TRANSPORT=tcp FERROCOMM_ENCRYPT=off FERROCOMM_TOKEN="$token" "$launcher"
          -n $((n / 2)) --nnodes 2 --master-addr "$addr_a" --master-port "$port")
        two_hosts ip netns exec "$nsb" "${run[@]}" --node-rank 1 -- "$bench" "${args[@]}" \
          \; ip netns exec "$nsa" "${run[@]}" --node-rank 0 -- "$bench" "${args[@]}" --json "$file" || return
        ;;
    esac
  done
}

# `capped ITERS WARMUP SWEEP...` prints the sweeps with at most ITERS iterations and WARMUP
# warm-ups each: for tools whose calls take so long that fewer of them measure as well.
capped() {
  local max_it=$1 max_wu=$2 s lo hi f it wu
  shift 2
  for s in "$@"; do
    IFS=: read -r lo hi f it wu <<<"$s"
    echo "$lo:$hi:$f:$((it > max_it ? max_it : it)):$((wu > max_wu ? max_wu : wu))"
  done
}

# Debian's MPICH 4 is ch4:ucx. MPIR_CVAR_NOLOCAL=1 stops MPICH treating ranks of one host as
# local (its shared memory and node-aware collectives), and UCX_TLS=tcp stops UCX using its
# own shared memory: together every byte goes over TCP. ch4 has no yield setting (the notes
# below): with more ranks than cores it polls through whole time slices, milliseconds per
# call, so there it gets at most 50 iterations per size.
run_mpich() {
  local t=$1 n=$2 op=$3 json=$4 sweeps
  shift 4
  if [ "$n" -gt "$cores" ]; then mapfile -t sweeps < <(capped 50 5 "$@"); else sweeps=("$@"); fi
  local prog=(target/peers/mpi_bench_mpich "$op" "$json" --settle-ms="$(settle_ms "$n")" "${sweeps[@]}") bind
  read -ra bind <<<"$(bind_mpich "$n")"
  case $t in
    shm) "${limit[@]}" mpiexec.mpich "${bind[@]}" -n "$n" "${prog[@]}" ;;
    tcp-loopback)
      MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp UCX_NET_DEVICES=lo "${limit[@]}" mpiexec.mpich "${bind[@]}" -n "$n" "${prog[@]}"
      ;;
    tcp-veth)
      # hydra starts its proxy on the other "host" through netns_exec.sh (an ssh stand-in),
      # which calls back at -localhost, the first namespace's address.
      MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp "${limit[@]}" ip netns exec "$nsa" mpiexec.mpich \
        -launcher ssh -launcher-exec "$agent" -localhost "$addr_a" \
        -hosts "$addr_a:$((n / 2)),$addr_b:$((n / 2))" -n "$n" "${prog[@]}"
      ;;
  esac
}

# Open MPI 4.1: ob1 with the vader (shared memory) BTL by default; TCP with `--mca btl tcp,self`.
# It spins while it waits unless mpi_yield_when_idle is set, which it gets wherever processes
# outnumber the cores: more ranks than cores, and across the namespaces, where its launcher
# daemons share the cores with the ranks (without it an 8-byte all_reduce at 2 ranks took
# milliseconds there: whole time slices).
run_openmpi() {
  local t=$1 n=$2 op=$3 json=$4
  shift 4
  local prog=(target/peers/mpi_bench_openmpi "$op" "$json" --settle-ms="$(settle_ms "$n")" "$@") opts=()
  if [ "$n" -gt "$cores" ]; then opts+=(--oversubscribe); fi
  if [ "$n" -gt "$cores" ] || [ "$t" = tcp-veth ]; then opts+=(--mca mpi_yield_when_idle 1); fi
  case $t in
    shm) "${limit[@]}" mpirun.openmpi "${opts[@]}" -n "$n" "${prog[@]}" ;;
    tcp-loopback)
      "${limit[@]}" mpirun.openmpi "${opts[@]}" --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo \
        -n "$n" "${prog[@]}"
      ;;
    tcp-veth)
      "${limit[@]}" ip netns exec "$nsa" mpirun.openmpi "${opts[@]}" --mca pml ob1 --mca btl tcp,self \
        --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
        --mca plm_rsh_agent "$agent" --host "$addr_a:$((n / 2)),$addr_b:$((n / 2))" -n "$n" "${prog[@]}"
      ;;
  esac
}

# Gloo: TCP only. Its small calls take 0.1-1 ms, so its sweeps get at most 200 iterations;
# with more ranks than cores, milliseconds, so at most 50 as MPICH's.
run_gloo() {
  local t=$1 n=$2 op=$3 json=$4 sweeps
  shift 4
  if [ "$n" -gt "$cores" ]; then mapfile -t sweeps < <(capped 50 5 "$@"); else mapfile -t sweeps < <(capped 200 1000 "$@"); fi
  local prog=(benches/peers/gloo_bench.py "$op" "$json" --settle-ms="$(settle_ms "$n")" "${sweeps[@]}")
  case $t in
    tcp-loopback) GLOO_SOCKET_IFNAME=lo "${limit[@]}" "$torchrun" --standalone --nproc-per-node "$n" "${prog[@]}" ;;
    tcp-veth)
      port=$((port + 1))
      local run=("$torchrun" --nnodes 2 --nproc-per-node $((n / 2)) --master-addr "$addr_a" --master-port "$port")
      two_hosts ip netns exec "$nsb" env GLOO_SOCKET_IFNAME="$veth_b" "${run[@]}" --node-rank 1 "${prog[@]}" \
        \; ip netns exec "$nsa" env GLOO_SOCKET_IFNAME="$veth_a" "${run[@]}" --node-rank 0 "${prog[@]}"
      ;;
  esac
}

# ferrocomm runs twice in each repetition, first and last ("ferrocommagain"), around the peers.
# The report takes the geometric mean of the two as its time there, so that neither a drift
# across the repetition nor the first place counts for or against a tool, and their ratio as
# the noise floor: how far one build moves against itself across the time the peers took.
tools_of() { [ "$1" = shm ] && echo "ferrocomm mpich openmpi ferrocommagain" || echo "ferrocomm mpich openmpi gloo ferrocommagain"; }
run_ferrocommagain() { run_ferrocomm "$@"; }

# What the report says about how each tool ran: "transport|tool|text" per line.
mpich_is="MPICH $(mpichversion | awk '/Version:/ {print $3}'), $(mpichversion | awk '/Device:/ {print $3}')"
ompi_is="Open MPI $(ompi_info --parsable | awk -F: '/^ompi:version:full/ {print $4}')"
{
  echo "shm|ferrocomm|\`ferrocomm-bench OP --world N [--bind-to core]\` (shared memory)"
  echo "shm|mpich|\`mpiexec.mpich [-bind-to core] -n N\` ($mpich_is, defaults)"
  echo "shm|openmpi|\`mpirun.openmpi -n N\` ($ompi_is, defaults: ob1 with the vader BTL)"
  echo "tcp-loopback|ferrocomm|\`FERROCOMM_TRANSPORT=tcp ferrocomm-bench OP --world N [--bind-to core]\`"
  echo "tcp-loopback|mpich|\`MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp UCX_NET_DEVICES=lo mpiexec.mpich [-bind-to core] -n N\` (NOLOCAL turns off MPICH's own shared memory, UCX_TLS=tcp UCX's, which NOLOCAL alone leaves on; this build has no ch3 or ofi netmod to pick instead)"
  echo "tcp-loopback|openmpi|\`mpirun.openmpi --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo -n N\`"
  echo "tcp-loopback|gloo|\`GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node N\` (torch $("$py" -c 'import torch; print(torch.__version__)'))"
  echo "tcp-veth|ferrocomm|\`FERROCOMM_TRANSPORT=tcp FERROCOMM_ENCRYPT=off ferrocomm-run -n N/2 --nnodes 2 --node-rank R --master-addr 10.77.0.1 ...\` in each namespace (unsealed, like the peers)"
  echo "tcp-veth|mpich|\`MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp mpiexec.mpich -launcher ssh -launcher-exec scripts/netns_exec.sh -localhost 10.77.0.1 -hosts 10.77.0.1:N/2,10.77.0.2:N/2 -n N\` in the first namespace"
  echo "tcp-veth|openmpi|\`mpirun.openmpi --mca mpi_yield_when_idle 1 --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 --mca plm_rsh_agent scripts/netns_exec.sh --host 10.77.0.1:N/2,10.77.0.2:N/2 -n N\` in the first namespace (yield: its launcher daemons share the cores with the ranks)"
  echo "tcp-veth|gloo|\`GLOO_SOCKET_IFNAME=VETH torchrun --nnodes 2 --node-rank R --nproc-per-node N/2 --master-addr 10.77.0.1 ...\` in each namespace"
  echo "bind|all|With no more ranks than cores ($cores here), on one host ferrocomm runs with \`--bind-to core\` and MPICH with \`-bind-to core\`, one rank per core; Open MPI binds by default (to a core at up to 2 ranks, to a package above); Gloo (torchrun) has no such setting. Unbound, two ranks may share one core for a whole run (8-byte send/recv over TCP: 3.4–4.0 µs bound, up to 11.9 µs unbound, docs/results/cpu.md). Across the namespaces neither ferrocomm nor MPICH binds: each namespace's launcher would pick the same first cores. Open MPI's daemons do bind there, each from the first core: at 2 processes both ranks run on core 0 (both show \`Cpus_allowed_list: 0\`)"
  echo "over|ferrocomm|no setting: its waits spin briefly, then yield, then sleep"
  echo "over|mpich|none exists in $mpich_is: MPIR_CVAR_POLLS_BEFORE_YIELD is read by ch3:nemesis only, and MPIR_CVAR_DEFAULT_THREAD_LEVEL=MPI_THREAD_MULTIPLE (whose lock yields in some builds) did not change the time either; it busy-polls through its time slice"
  echo "over|openmpi|\`--oversubscribe --mca mpi_yield_when_idle 1\`"
  echo "over|gloo|no setting (it blocks in the kernel while it waits)"
} >>"$notes"

# --- sizes and iterations ----------------------------------------------------------------------
# Small sizes need many iterations for a stable mean, large ones few; TCP calls take longer
# than shared-memory ones, and the shaped link longer still. With more processes than cores
# every tool is time-sliced (a preempted rank stalls a call for milliseconds), and the run
# time goes to the small sizes' many iterations rather than to the large ones.
sweeps_for() { # transport, world size -> "lo:hi:factor:iters:warmup" per sweep
  local small=8:65536:2 large=262144:67108864:4
  if [ "$quick" = 1 ]; then
    echo "8:4096:512:200:10 1048576:16777216:16:5:1"
  elif [ "$2" -gt "$cores" ]; then
    echo "$small:500:20 $large:10:2"
  else
    case $1 in
      shm) echo "$small:2000:100 $large:20:3" ;;
      tcp-loopback) echo "$small:1000:50 $large:20:3" ;;
      tcp-veth) echo "$small:300:20 $large:10:2" ;;
    esac
  fi
}
for t in "${transports[@]}"; do
  for n in 2 4; do echo "$t|sweeps-$n|$(sweeps_for "$t" "$n")" >>"$notes"; done
done
echo "all|reps|$reps" >>"$notes"
echo "all|caps|Gloo gets at most 200 iterations per size (its small calls take 0.1–1 ms). With more ranks than cores, MPICH and Gloo get at most 50 (+5 warm-up): their calls take milliseconds there (MPICH polls through whole time slices), so 50 measure as long as the others' 500" >>"$notes"

# --- the runs ----------------------------------------------------------------------------------
# A tool that fails or hangs is logged and its rows left empty; the others go on. A failure
# after the JSON was written (mpi_bench's way out of a hung MPI_Finalize) keeps the rows.
failures=$out/failures.txt
: >"$failures"
ops=(all_reduce all_gather reduce_scatter all_to_all broadcast send_recv)
if [ -n "$only" ]; then
  read -ra ops <<<"$only"
fi
start=$SECONDS
for n in 2 4; do
  for op in "${ops[@]}"; do
    for rep in $(seq "$reps"); do
      for t in "${transports[@]}"; do
        mkdir -p "$out/$t"
        read -ra sweeps <<<"$(sweeps_for "$t" "$n")"
        for tool in $(tools_of "$t"); do
          echo "== $(((SECONDS - start) / 60)) min: n=$n $op rep $rep $t $tool"
          log=$out/logs/$t-$tool-$op-$n-r$rep.txt
          json=$out/$t/$tool-$op-$n-r$rep.json
          if ! "run_$tool" "$t" "$n" "$op" "$json" "${sweeps[@]}" >"$log" 2>&1; then
            kept=$({ [ -e "$json" ] || compgen -G "${json%.json}-*.json"; } >/dev/null && echo kept || echo none)
            echo "$t|$tool|$op|$n|$rep|$kept" >>"$failures"
            echo "   failed (rows: $kept): see $log"
          fi
        done
      done
    done
  done
done
echo "runs took $(((SECONDS - start) / 60)) min"

if [ "$quick" = 1 ] || [ -n "$only" ]; then
  md=$out/cpu.md img=$out
  cp docs/results/cpu.md "$md"
else
  md=docs/results/cpu.md img=docs/results
fi
for t in "${transports[@]}"; do
  # Every run of every tool: repeated runs of one tool, op and size merge, each size keeping
  # its fastest. ferrocomm's second runs stay out, so that it has as many runs as a peer.
  mapfile -t jsons < <(find "$out/$t" -name '*.json' ! -name 'ferrocommagain-*' | sort)
  "$bench" plot -o "$img/cpu-collectives$([ "$t" = shm ] || echo "-$t").png" "${jsons[@]}"
done
"$py" scripts/compare_report.py "$out" "$md" "$(git rev-parse --short HEAD)" \
  "./scripts/cpu_compare.sh$([ "$quick" = 1 ] && echo " --quick")$([ -n "$only" ] && echo " --ops \"$only\"")"
echo "wrote $md and its plots beside it"

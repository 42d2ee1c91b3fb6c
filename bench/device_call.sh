#!/usr/bin/env bash
# One device call: the set-up every call needs, then a call script (a list of commands).
#
#   MEGATRAIN_REV=<commit> OUT=/tmp/out bash bench/device_call.sh CALL_SCRIPT
#
# Set-up: strict pipes, unbuffered Python, NVLink multicast off (NCCL, PyTorch, NVSHMEM), MEGATRAIN_REV (the
# device's copy of the tree has no usable git history: pass the commit it runs; the JSONs record it), OUT (default
# /tmp/out), the wheels in .whl/ (carried to the
# device: pydantic, datasets, ... that its image lacks; WHEELS=DIR for another folder, WHEELS= for none) installed
# into /tmp/site and put first on PYTHONPATH, and the machine (GPUs and, with several, their topology, Python,
# torch, CUDA, the libraries megatrain imports, CPUs, memory) printed and saved to $OUT/machine.txt. The call script
# is then sourced in a subshell (an `exit` in it ends the call script, not this runner) with OUT, M
# (bench/model-configs) and the helpers below available; a copy of it is kept as $OUT/run.sh.
#
#   run_logged NAME SECONDS CMD ARGS...   runs CMD under `timeout SECONDS`, its output to $OUT/NAME.log (the last
#                                         ${TAIL:-6} lines shown), and appends "NAME rc=N" to $OUT/status.txt
#   run_detached NAME CMD ARGS...         for a run longer than one device command (10 minutes): the first call
#                                         starts CMD in its own process session (setsid; output and exit status
#                                         under $DETACHED/NAME, default /tmp/detached), and every call (the same
#                                         call script issued again on the still-warm machine) waits for it until
#                                         this command's deadline (its start + ${WAIT_S:-570} s), shows the last
#                                         ${TAIL:-8} lines of its output, copies it to $OUT/NAME.log and, once it
#                                         has ended, appends "NAME rc=N" to $OUT/status.txt (returns 0 while it
#                                         runs). `detached_started NAME` says whether it was started already,
#                                         `detached_done NAME` whether this call saw it end ("NAME rc=" in status.txt)
#   bundle_results NAME DIR               the logs and JSONs of DIR in one $OUT/NAME.tar.gz (a command brings back
#                                         at most 8 files)
#   run_in DIR NAME SECONDS CMD ARGS...   one run of a chain started with run_detached (the functions are exported
#                                         to it): waits until no process holds a GPU (`gpus_free`, at most 120 s),
#                                         runs CMD under `timeout`, its output to DIR/NAME.log, and prints its exit
#                                         status and last 3 lines
# The runner's exit status is the call script's, or 1 if it was 0 but a command run with run_logged failed.
set -uo pipefail
if [ $# -ne 1 ] || [ ! -f "$1" ]; then
  echo "usage: [MEGATRAIN_REV=<commit>] [OUT=DIR] bash bench/device_call.sh CALL_SCRIPT" >&2
  exit 2
fi
CALL=$(realpath "$1")
cd "$(dirname "$0")/.."  # the repository root: call scripts name bench/... and $M relative to it
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
# The image's Python packages come without bytecode and Python does not cache it beside them: every process compiled
# torch's and transformers' sources again (about 10 s of each start, 3,400 modules). A pip install compiles them once;
# a bytecode cache under /tmp does the same for every process of this machine after the first.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
# NVLink multicast stays off on the multi-GPU kinds (the device's KINDS.md: a program that uses it can take the host's
# shared GPUs out of service); the machines set these, and every run of a call inherits them from here as well
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/out} M=bench/model-configs
mkdir -p "$OUT"
cp "$CALL" "$OUT/run.sh"

WHEELS=${WHEELS-.whl}  # WHEELS= (empty): install nothing (a check of a call script on a machine that has them)
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || { echo "device_call: installing $WHEELS/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  echo "call: $CALL  rev: $MEGATRAIN_REV  date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  # several GPUs: how they are linked (NVLink or PCIe through the host), which sets NCCL's reduce-scatter rate
  [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ] && nvidia-smi topo -m 2>/dev/null
  python3 - <<'EOF'
import platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"devices {torch.cuda.device_count()}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}")
for name in ("transformers", "triton", "typing_extensions", "pydantic", "pyarrow", "datasets", "pytest",
             "megatrain.config"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '')} ({mod.__file__})")
    except Exception as e:  # ImportError, or a library refusing an old dependency
        print(f"{name}: not importable ({e})")
EOF
  echo "CPUs: $(nproc)"
  # sockets, cores and threads per core: whether "16 cores per GPU" are hyperthreads (the CPU AdamW's thread count)
  lscpu 2>/dev/null | grep -E "^(Model name|Socket\(s\)|Core\(s\) per socket|Thread\(s\) per core|NUMA node\(s\)):" || true
  free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"

run_logged() {
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-6}" "$OUT/$name.log"
  echo "$name rc=$rc" | tee -a "$OUT/status.txt"
  return $rc
}
export -f run_logged

export CALL_DEADLINE=$(( $(date +%s) + ${WAIT_S:-570} )) DETACHED=${DETACHED:-/tmp/detached}
detached_started() {
  [ -f "$DETACHED/$1/pid" ]
}
run_detached() {
  local name=$1 d=$DETACHED/$1
  shift
  if [ ! -f "$d/pid" ]; then
    mkdir -p "$d"
    date +%s > "$d/start"
    setsid bash -c '"$@" > "$0/out.log" 2>&1; echo $? > "$0/rc"' "$d" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$d/pid"
    echo "$name launched (setsid, pid $(cat "$d/pid")): $*" | tee -a "$OUT/status.txt"
  fi
  while [ ! -f "$d/rc" ] && [ "$(date +%s)" -lt "$CALL_DEADLINE" ]; do
    sleep "${POLL_S:-15}"
  done
  echo "$name: $(( $(date +%s) - $(cat "$d/start") )) s since launch; rc: $(cat "$d/rc" 2>/dev/null || echo running)"
  tail -n "${TAIL:-8}" "$d/out.log"
  cp "$d/out.log" "$OUT/$name.log"
  [ -f "$d/rc" ] || return 0
  echo "$name rc=$(cat "$d/rc")" | tee -a "$OUT/status.txt"
  return "$(cat "$d/rc")"
}
detached_done() {
  grep -q "^$1 rc=" "$OUT/status.txt" 2>/dev/null
}
bundle_results() {
  local files
  files=$(cd "$2" && ls -- *.log *.json 2>/dev/null)
  [ -n "$files" ] && tar czf "$OUT/$1.tar.gz" -C "$2" $files
}
gpus_free() {  # waits (at most 120 s) until no process holds a GPU; says which still do
  for _ in $(seq 120); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "GPUs still held: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
}
run_in() {  # DIR NAME SECONDS CMD...: one run of a detached chain, once the GPUs are free: CMD under timeout, its
  local dir=$1 name=$2 seconds=$3  # output to DIR/NAME.log, its exit status and last lines printed
  shift 3
  gpus_free
  echo "== $name, $(date -u +%T): $*"
  timeout "$seconds" "$@" > "$dir/$name.log" 2>&1
  echo "$name: rc=$?, $(date -u +%T)"
  tail -n 3 "$dir/$name.log"
}
export -f detached_started run_detached detached_done bundle_results gpus_free run_in

( source "$CALL" )
rc=$?
echo "== call script exit status $rc"
[ -f "$OUT/status.txt" ] && cat "$OUT/status.txt"
if [ $rc -eq 0 ] && [ -f "$OUT/status.txt" ] && grep -qE " rc=[1-9]" "$OUT/status.txt"; then
  rc=1  # a command run with run_logged failed
fi
exit $rc

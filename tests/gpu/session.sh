#!/usr/bin/env bash
# The whole GPU check in one command, for a machine with an NVIDIA GPU (issue 13's list):
# the machine's facts, devicekit's commands against nvidia-smi and torch.cuda, leases under a
# running job, a torchrun-style script under `devicekit run`, the full test suite, the GPU
# tests, and the GPU parts of the benchmarks. Logs go to $OUT (default /tmp/devicekit-gpu).
#
#   bash tests/gpu/session.sh [facts] [cli] [tests] [bench] [BENCH_NAME ...]   # default: all
#
# Runs from the source tree (PYTHONPATH=src); wheels in .whl/ (GPUtil, gpustat, ...) are
# installed into /tmp/site first when present. Each part is bounded in time.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/devicekit-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  export PATH=/tmp/site/bin:$PATH
fi
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(facts cli tests bench)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
dk() { echo "\$ devicekit $*"; timeout 120 python3 -m devicekit "$@"; echo "[exit $?]"; }

if want facts; then
  {
    nvidia-smi
    nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,pci.bus_id,driver_version,compute_cap --format=csv
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
    python3 -c "import pynvml; print('nvidia-ml-py', getattr(pynvml, '__version__', '?'))"
    nproc; free -g | head -2
    echo "--- NVML cost per call (tests/gpu/nvml_costs.py)"
    timeout 60 python3 tests/gpu/nvml_costs.py
  } >"$OUT/facts.log" 2>&1
fi

if want cli; then
  {
    dk status; dk status --json; dk doctor; dk doctor --json; dk select; dk select -n 2
    dk select --min-free 1000GiB; dk select --format index
    echo "--- truth: devicekit vs nvidia-smi and torch.cuda"
    timeout 120 python3 tests/gpu/truth.py; echo "[exit $?]"
    echo "--- lease held by a running job; a second select must not get the GPU"
    timeout 120 python3 -m devicekit run --gpus 1 -- python3 -c "import time; time.sleep(25)" &
    sleep 12; dk select; dk status; wait
    echo "--- the bundled example"
    dk run
    echo "--- a torchrun-style script (LOCAL_RANK, nccl, DistributedSampler), unchanged"
    timeout 200 python3 -m devicekit run --gpus 1 -- python3 tests/gpu/torchrun_style.py
    echo "[exit $?]"
    echo "--- the same script under plain torchrun"
    timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 tests/gpu/torchrun_style.py
    echo "[exit $?]"
  } >"$OUT/cli.log" 2>&1
fi

if want tests; then
  timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q --timeout 120 -p no:cacheprovider -m gpu tests/gpu -rfEs \
    >"$OUT/pytest-gpu.log" 2>&1; echo "[exit $?]" >>"$OUT/pytest-gpu.log"
  # serially the suite outran 250 s on the H100 machine (CUDA start-up in many processes);
  # pytest-xdist with one file per worker ran it in 50 s
  xdist=(); python3 -c "import xdist" 2>/dev/null && xdist=(-n 8 --dist loadfile)
  timeout "${ALL_TESTS_S:-300}" python3 -m pytest -q --timeout 120 -p no:cacheprovider --ignore tests/gpu \
    "${xdist[@]}" --tb=short -rfE \
    >"$OUT/pytest-all.log" 2>&1; echo "[exit $?]" >>"$OUT/pytest-all.log"
fi

if want bench; then
  names=()
  for p in "${parts[@]}"; do case $p in bench_*) names+=("$p");; esac; done
  timeout 560 python3 benchmarks/run_all.py "${names[@]}" >"$OUT/bench.log" 2>&1
  echo "[exit $?]" >>"$OUT/bench.log"
fi
for f in "$OUT"/*.log; do echo "== $f"; grep -E "passed|failed|MISMATCH|all OK|\[exit|error" "$f" | tail -8; done

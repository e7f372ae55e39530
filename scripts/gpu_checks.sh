#!/usr/bin/env bash
# The GPU checks in one go: the Triton kernels against their references (int8 and fp8 caches
# included), the GPU tests (float32 exactness against transformers, swap, bfloat16 serving, decode
# graphs, 8-bit KV on the Triton kernel, KV over CUDA IPC), then the GPU benchmarks (decoding, KV
# over IPC, swap copies), the device memory of loading every kernel at start and role changes
# under both loadings. Each step has a time limit and a log of its own in OUTDIR, and a failing
# step does not stop the next.
#
#   bash scripts/gpu_checks.sh [OUTDIR]
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run it with a limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $python -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
} >"$out/env.txt" 2>&1
step kernels "${KERNELS_LIMIT:-120}" $python -m pytest -p no:cacheprovider -q -rs \
    tests/test_triton_attention.py tests/test_slot_copy.py
# TESTS_K selects tests (pytest -k), BENCH_ARGS adds bench_gpu.py options: for a short run.
step tests "${TESTS_LIMIT:-300}" $python -m pytest -m gpu -p no:cacheprovider -q -rs --durations=15 \
    ${TESTS_K:+-k "$TESTS_K"} tests/test_gpu.py tests/test_kv_ipc.py
# shellcheck disable=SC2086
step bench_gpu "${BENCH_LIMIT:-240}" $python scripts/benchmarks/bench_gpu.py --json "$out/bench_gpu.json" ${BENCH_ARGS:-}
step bench_kv_ipc "${IPC_LIMIT:-90}" $python scripts/benchmarks/bench_kv_ipc.py --json "$out/bench_kv_ipc.json"
step bench_swap "${SWAP_LIMIT:-90}" $python scripts/benchmarks/bench_swap.py --json "$out/bench_swap.json"
# What loading every kernel at start (instances' default) costs in device memory, against CUDA's
# lazy default: a process that has run a matrix product and SDPA, each way.
for mode in LAZY EAGER; do
    step "module_loading_$mode" 60 env CUDA_MODULE_LOADING=$mode $python -c "
import torch, torch.nn.functional as F
x = torch.randn(8, 1024, 1024, device='cuda', dtype=torch.bfloat16)
F.scaled_dot_product_attention(x[None], x[None], x[None], is_causal=True); x @ x
torch.cuda.synchronize(); free, total = torch.cuda.mem_get_info()
print('$mode: device memory in use', round((total - free) / 2**20), 'MiB')"
done
# Role changes with kernels loaded lazily and at start (needs Ray).
for mode in LAZY EAGER; do
    step "role_change_$mode" "${ROLE_LIMIT:-150}" env CUDA_MODULE_LOADING=$mode $python scripts/benchmarks/bench_role_change.py \
        --device cuda --model llama-3-8b --load-format dummy --changes 16 --rate 10
done
cat "$out/summary.txt"

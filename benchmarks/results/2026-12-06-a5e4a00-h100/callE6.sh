#!/usr/bin/env bash
# Eighth session, call E6: (1) the probe of cuBLAS's beta = 1 at few rows (bench_fewrow_addmm.py);
# (2) the residual products of at most 8 rows and 4096 inputs as mm then add
# (SLIPSTREAM_FEWROW_MM_ADD=8:4096: the 8B shape's o_proj) against addmm, in turn, twice: n-gram
# k = 3 and EAGLE-3 k = 3 at batch 1 (twice), seed-8b-bs8 (once).
B="bash benchmarks/gpu_run.sh"
E3='{"method":"eagle3","model":"slipstream/bench/configs/llama-3.1-8b-eagle3/config.json","num_speculative_tokens":3}'
N3='{"method":"ngram","num_speculative_tokens":3}'
M="--gpu-memory-utilization 0.8"
ON="SLIPSTREAM_FEWROW_MM_ADD=8:4096"
$B env
export PYTHONPATH=/tmp/site:.:${PYTHONPATH:-}
timeout 120 python3 benchmarks/bench_fewrow_addmm.py --out /tmp/res > /tmp/res/fewrow-addmm.log 2>&1; tail -n 20 /tmp/res/fewrow-addmm.log >> $OUT/log.txt
REPS=2 WORKLOADS="seed-8b-bs1" ARMS="X=1 --speculative-config $N3 --spec-synthetic-accept 2;$ON --speculative-config $N3 --spec-synthetic-accept 2;X=1 $M --speculative-config $E3 --spec-synthetic-accept 2.5;$ON $M --speculative-config $E3 --spec-synthetic-accept 2.5" $B ab-env
REPS=1 WORKLOADS="seed-8b-bs8" ARMS="X=1;$ON" $B ab-env
mkdir -p /tmp/res/mmadd; mv /tmp/res/ab-env-* /tmp/res/mmadd/

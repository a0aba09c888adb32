#!/bin/bash
# A model-args file in the shape of slime's scripts/models/*.sh.
NLAYERS=${NLAYERS:-12}

MODEL_ARGS=(
   --swiglu
   --num-layers ${NLAYERS:-12}
   --hidden-size 512
   --num-attention-heads 8   # heads
   --group-query-attention
   --num-query-groups 2
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --no-position-embedding
   --rotary-base 10000
   --lr-decay-style linear
   --untie-embeddings-and-output-weights
)

MODEL_ARGS=(
   --num-layers 12
   --lr fast
   --eps-clip 0.1 0.2
)

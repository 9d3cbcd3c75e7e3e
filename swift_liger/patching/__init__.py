"""The patching toolkit every fusion patches through: the per-instance PatchState (state.py), the family tables
(families.py), HF forwards rebound to our kernels (rebind.py), PEFT LoRA glue (lora.py), decoder-layer checkpoint
functions (checkpoint_funcs.py, offload.py). Nothing here imports the fusions or the patcher above it; this
package's __init__ imports nothing, so ``patching.families`` loads without torch."""

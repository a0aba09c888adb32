package engines

// LoRATargets are the projections a LoRA adapter may adapt (the targets of a policy's lora:
// block), in the order of a decoder layer: attention's q, k, v and o, then the MLP's gate, up and
// down.
var LoRATargets = []string{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

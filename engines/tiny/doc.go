// Package tiny is slimen's embedded policy engine: a small Llama-family language model (RMSNorm,
// rotary embeddings, grouped-query attention, SwiGLU, tied or untied LM head) in pure Go, float32,
// on every core. It generates with a KV cache, scores, and trains with the policy loss of
// docs/architecture.md through a hand-written backward pass and AdamW, so that a multi-agent RL script runs,
// and learns, on any laptop without a GPU or a download.
//
// It also serves as a PPO critic (engines.Valuer, capability "values"): a value head, a linear map
// hidden → 1 (with a bias) on the final-norm hidden state, is created with zeros on first use —
// by Values or by a Train batch whose samples carry Returns — and Values reports it at the
// position that predicts each token. Such a batch trains the whole model and the head with the
// clipped value loss max((V − R)², (clip(V, V_old ± ValueClip) − R)²), reduced like the policy
// loss, and AdamW; the head is saved in model.safetensors as score.weight and score.bias, the
// PyTorch engine's names, so critic checkpoints move between the two engines.
//
// Models are Hugging Face folders (config.json for LlamaForCausalLM, model.safetensors with the
// standard tensor names, tokenizer.json and tokenizer_config.json with a chat template) that
// transformers loads as they are; testdata/tiny_compat/ proves it. The vocabulary is either
// character-level (builtin:tiny-arith: printable ASCII, newline and the special tokens
// <|system|>, <|user|>, <|assistant|>, <|end|> (end of turn and of sequence), <|pad|> and <|unk|>)
// or a byte-level BPE trained by TrainBPE with Qwen3's chat format and tools (QwenChatTemplate).
//
// The API:
//
//	e, err := tiny.Open("builtin:tiny-arith", tiny.Options{}) // or a model folder
//	e, err := tiny.New(tiny.DefaultConfig(), seed, tiny.Options{}) // random weights
//	var _ engines.Engine = e                                      // Generate, Score, Train, Save, …
//	var _ engines.Valuer = e                                      // Values: a PPO critic
//	err = tiny.Pretrain(ctx, e, examples, tiny.PretrainOptions{Steps: 3000})
//
// Everything is deterministic: a completion depends only on the weights, its prompt, its sampling
// settings and its sample index — not on the rest of its batch, the goroutine schedule or the
// number of threads — and a training step maps the same weights and batch to the same new
// weights, bit for bit. Every matrix element is one sequential sum (matMulT), attention has one
// implementation for prefill, decode and training (attendRow), and exp and log are the package's
// own so that no platform-dependent fused multiply-add changes a bit. On amd64 with AVX2 the
// products, exp, SwiGLU and attention's sums run in Go assembly that vectorises across elements
// and keeps each element's operations and their order, so its results equal the portable Go
// code's bit for bit (the purego build tag selects the Go code).
//
// builtin:tiny-arith, embedded from builtin/, is the base model of the examples, trained by
// `slimen pretrain` on synthetic:arith; docs/tiny.md has its recipe and measured speeds.
package tiny

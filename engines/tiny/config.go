package tiny

import (
	"encoding/json"
	"fmt"
	"slices"
)

// ModelConfig is the architecture of a tiny model. Its file form is the config.json of a Hugging
// Face LlamaForCausalLM; zero fields take the defaults of DefaultConfig where noted.
type ModelConfig struct {
	VocabSize     int     // embedding rows; 0: the size of the character vocabulary
	Hidden        int     // hidden_size (d_model)
	Intermediate  int     // intermediate_size of the SwiGLU MLP
	Layers        int     // num_hidden_layers
	Heads         int     // num_attention_heads
	KVHeads       int     // num_key_value_heads; divides Heads (grouped-query attention)
	HeadDim       int     // head_dim; 0: Hidden/Heads
	MaxSeqLen     int     // max_position_embeddings: longest prompt + response
	RMSNormEps    float64 // 0: 1e-5
	RopeTheta     float64 // 0: 10000
	TieEmbeddings bool    // the LM head reuses the embedding matrix
}

// DefaultConfig is the architecture of builtin:tiny-arith; see docs/tiny.md for how it was chosen.
func DefaultConfig() ModelConfig {
	return ModelConfig{
		Hidden:        64,
		Intermediate:  192,
		Layers:        2,
		Heads:         4,
		KVHeads:       2,
		MaxSeqLen:     512,
		TieEmbeddings: true,
	}
}

// withDefaults fills the fields whose zero value means "default".
func (c ModelConfig) withDefaults(vocab int) ModelConfig {
	if c.VocabSize == 0 {
		c.VocabSize = vocab
	}
	if c.HeadDim == 0 && c.Heads > 0 {
		c.HeadDim = c.Hidden / c.Heads
	}
	if c.KVHeads == 0 {
		c.KVHeads = c.Heads
	}
	if c.RMSNormEps == 0 {
		c.RMSNormEps = 1e-5
	}
	if c.RopeTheta == 0 {
		c.RopeTheta = 10000
	}
	return c
}

func (c ModelConfig) validate() error {
	switch {
	case c.VocabSize <= 0 || c.Hidden <= 0 || c.Intermediate <= 0 || c.Layers <= 0 || c.Heads <= 0:
		return fmt.Errorf("vocab_size, hidden_size, intermediate_size, num_hidden_layers and num_attention_heads must be positive (got %d, %d, %d, %d, %d)",
			c.VocabSize, c.Hidden, c.Intermediate, c.Layers, c.Heads)
	case c.KVHeads <= 0 || c.Heads%c.KVHeads != 0:
		return fmt.Errorf("num_key_value_heads %d must divide num_attention_heads %d", c.KVHeads, c.Heads)
	case c.HeadDim <= 0 || c.HeadDim%2 != 0:
		return fmt.Errorf("head_dim %d must be positive and even (rotary embeddings rotate pairs)", c.HeadDim)
	case c.MaxSeqLen <= 1:
		return fmt.Errorf("max_position_embeddings %d must be at least 2", c.MaxSeqLen)
	case !(c.RMSNormEps > 0) || !(c.RopeTheta > 0):
		return fmt.Errorf("rms_norm_eps and rope_theta must be positive")
	}
	return nil
}

// qDim and kvDim are the widths of the query and of the key/value projections.
func (c ModelConfig) qDim() int  { return c.Heads * c.HeadDim }
func (c ModelConfig) kvDim() int { return c.KVHeads * c.HeadDim }

// params is the number of parameters.
func (c ModelConfig) params() int64 {
	d, v := int64(c.Hidden), int64(c.VocabSize)
	layer := 2*d + d*int64(c.qDim())*2 + d*int64(c.kvDim())*2 + 3*d*int64(c.Intermediate)
	n := v*d + int64(c.Layers)*layer + d
	if !c.TieEmbeddings {
		n += v * d
	}
	return n
}

// hfConfig is config.json as transformers 5 writes it for LlamaForCausalLM. Fields transformers
// needs to rebuild the same model are written; on reading, the ones that change the computation
// are checked.
type hfConfig struct {
	Architectures         []string        `json:"architectures"`
	ModelType             string          `json:"model_type"`
	VocabSize             int             `json:"vocab_size"`
	HiddenSize            int             `json:"hidden_size"`
	IntermediateSize      int             `json:"intermediate_size"`
	NumHiddenLayers       int             `json:"num_hidden_layers"`
	NumAttentionHeads     int             `json:"num_attention_heads"`
	NumKeyValueHeads      int             `json:"num_key_value_heads"`
	HeadDim               int             `json:"head_dim"`
	HiddenAct             string          `json:"hidden_act"`
	MaxPositionEmbeddings int             `json:"max_position_embeddings"`
	RMSNormEps            float64         `json:"rms_norm_eps"`
	RopeParameters        *ropeParameters `json:"rope_parameters,omitempty"`
	RopeTheta             float64         `json:"rope_theta,omitempty"` // transformers 4 spelling, read only
	RopeScaling           json.RawMessage `json:"rope_scaling,omitempty"`
	TieWordEmbeddings     bool            `json:"tie_word_embeddings"`
	AttentionBias         bool            `json:"attention_bias"`
	MLPBias               bool            `json:"mlp_bias"`
	AttentionDropout      float64         `json:"attention_dropout"`
	BOSTokenID            *int32          `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
	PadTokenID            *int32          `json:"pad_token_id"`
	DType                 string          `json:"dtype"`
	UseCache              bool            `json:"use_cache"`
}

type ropeParameters struct {
	RopeType  string  `json:"rope_type"`
	RopeTheta float64 `json:"rope_theta"`
}

func (c ModelConfig) toHF(eos []int32, pad int32) hfConfig {
	eosJSON, _ := json.Marshal(eos)
	if len(eos) == 1 {
		eosJSON, _ = json.Marshal(eos[0])
	}
	return hfConfig{
		Architectures:         []string{"LlamaForCausalLM"},
		ModelType:             "llama",
		VocabSize:             c.VocabSize,
		HiddenSize:            c.Hidden,
		IntermediateSize:      c.Intermediate,
		NumHiddenLayers:       c.Layers,
		NumAttentionHeads:     c.Heads,
		NumKeyValueHeads:      c.KVHeads,
		HeadDim:               c.HeadDim,
		HiddenAct:             "silu",
		MaxPositionEmbeddings: c.MaxSeqLen,
		RMSNormEps:            c.RMSNormEps,
		RopeParameters:        &ropeParameters{RopeType: "default", RopeTheta: c.RopeTheta},
		TieWordEmbeddings:     c.TieEmbeddings,
		EOSTokenID:            eosJSON,
		PadTokenID:            &pad,
		DType:                 "float32",
		UseCache:              true,
	}
}

// parseHFConfig reads config.json, refusing what the tiny engine does not compute.
func parseHFConfig(data []byte) (ModelConfig, []int32, error) {
	var h hfConfig
	if err := json.Unmarshal(data, &h); err != nil {
		return ModelConfig{}, nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if !slices.Contains(h.Architectures, "LlamaForCausalLM") {
		return ModelConfig{}, nil, fmt.Errorf("architectures %q is not supported: the tiny engine runs LlamaForCausalLM only", h.Architectures)
	}
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return ModelConfig{}, nil, fmt.Errorf("hidden_act %q is not supported (silu only)", h.HiddenAct)
	}
	if h.AttentionBias || h.MLPBias {
		return ModelConfig{}, nil, fmt.Errorf("attention_bias and mlp_bias are not supported")
	}
	if len(h.RopeScaling) > 0 && string(h.RopeScaling) != "null" {
		return ModelConfig{}, nil, fmt.Errorf("rope_scaling is not supported")
	}
	theta := h.RopeTheta
	if h.RopeParameters != nil {
		if t := h.RopeParameters.RopeType; t != "" && t != "default" {
			return ModelConfig{}, nil, fmt.Errorf("rope_parameters.rope_type %q is not supported (default only)", t)
		}
		theta = h.RopeParameters.RopeTheta
	}
	c := ModelConfig{
		VocabSize:     h.VocabSize,
		Hidden:        h.HiddenSize,
		Intermediate:  h.IntermediateSize,
		Layers:        h.NumHiddenLayers,
		Heads:         h.NumAttentionHeads,
		KVHeads:       h.NumKeyValueHeads,
		HeadDim:       h.HeadDim,
		MaxSeqLen:     h.MaxPositionEmbeddings,
		RMSNormEps:    h.RMSNormEps,
		RopeTheta:     theta,
		TieEmbeddings: h.TieWordEmbeddings,
	}.withDefaults(0)
	if err := c.validate(); err != nil {
		return ModelConfig{}, nil, err
	}
	var eos []int32
	if len(h.EOSTokenID) > 0 && string(h.EOSTokenID) != "null" {
		var one int32
		if err := json.Unmarshal(h.EOSTokenID, &one); err == nil {
			eos = []int32{one}
		} else if err := json.Unmarshal(h.EOSTokenID, &eos); err != nil {
			return ModelConfig{}, nil, fmt.Errorf("eos_token_id must be an integer or a list of integers")
		}
	}
	return c, eos, nil
}

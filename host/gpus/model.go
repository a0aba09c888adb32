package gpus

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Model is what the memory estimate needs of a Hugging Face model folder: its parameter count
// (from the safetensors headers, so exact) and the shape of one KV-cache row (from config.json).
type Model struct {
	Params  int64
	Layers  int
	KVHeads int
	HeadDim int
	// MaxPositions is max_position_embeddings (0: not given), which bounds the worker's cache rows.
	MaxPositions int
}

// ReadModel reads a model folder's shape without loading its weights.
func ReadModel(dir string) (Model, error) {
	var cfg struct {
		Hidden  int `json:"hidden_size"`
		Layers  int `json:"num_hidden_layers"`
		Heads   int `json:"num_attention_heads"`
		KVHeads int `json:"num_key_value_heads"`
		HeadDim int `json:"head_dim"`
		MaxPos  int `json:"max_position_embeddings"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return Model{}, fmt.Errorf("model %s: %w", dir, err)
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return Model{}, fmt.Errorf("model %s: config.json: %w", dir, err)
	}
	if cfg.Hidden <= 0 || cfg.Layers <= 0 || cfg.Heads <= 0 {
		return Model{}, fmt.Errorf("model %s: config.json lacks hidden_size, num_hidden_layers or num_attention_heads", dir)
	}
	m := Model{Layers: cfg.Layers, KVHeads: cfg.KVHeads, HeadDim: cfg.HeadDim, MaxPositions: cfg.MaxPos}
	if m.KVHeads <= 0 {
		m.KVHeads = cfg.Heads
	}
	if m.HeadDim <= 0 {
		m.HeadDim = cfg.Hidden / cfg.Heads
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	if len(files) == 0 {
		return Model{}, fmt.Errorf("model %s: no *.safetensors files", dir)
	}
	for _, f := range files {
		n, err := safetensorsParams(f)
		if err != nil {
			return Model{}, err
		}
		m.Params += n
	}
	return m, nil
}

// safetensorsParams counts the elements of the tensors in a safetensors file from its header (an
// 8-byte little-endian length, then JSON naming each tensor's shape).
func safetensorsParams(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	var n uint64
	if err := binary.Read(f, binary.LittleEndian, &n); err != nil {
		return 0, fmt.Errorf("%s: safetensors header: %w", path, err)
	}
	if n > 100<<20 {
		return 0, fmt.Errorf("%s: safetensors header of %d bytes: not a safetensors file", path, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(f, b); err != nil {
		return 0, fmt.Errorf("%s: safetensors header: %w", path, err)
	}
	var header map[string]json.RawMessage
	if err := json.Unmarshal(b, &header); err != nil {
		return 0, fmt.Errorf("%s: safetensors header: %w", path, err)
	}
	var total int64
	for name, raw := range header {
		if name == "__metadata__" {
			continue
		}
		var t struct {
			Shape []int64 `json:"shape"`
		}
		if err := json.Unmarshal(raw, &t); err != nil {
			return 0, fmt.Errorf("%s: tensor %s: %w", path, name, err)
		}
		k := int64(1)
		for _, d := range t.Shape {
			k *= d
		}
		total += k
	}
	return total, nil
}

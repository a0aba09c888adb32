package tiny

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
)

// foldLoRA adds the adapter's update to the weights it targets: W += s·B·A (accumulated in
// float64), the model a merged export holds.
func foldLoRA(w *weights[float32], ad *loraWeights[float32]) {
	r := ad.cfg.Rank
	for l := range w.cfg.Layers {
		lw := &w.layers[l]
		for ti, dst := range [nTargets][]float32{lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.d} {
			a, b := ad.a[l][ti], ad.b[l][ti]
			if a == nil {
				continue
			}
			out, in := w.cfg.projShape(ti)
			row := make([]float64, in)
			for i := range out {
				clear(row)
				for k := range r {
					bik := float64(b[i*r+k])
					for j, x := range a[k*in : (k+1)*in] {
						row[j] += bik * float64(x)
					}
				}
				for j := range in {
					dst[i*in+j] += float32(float64(ad.scale) * row[j])
				}
			}
		}
	}
}

// SaveMerged writes the base with the adapter folded into its weights as a plain Hugging Face
// folder (config.json, model.safetensors, the tokenizer files): a model that computes what the
// base with the adapter computes, for tools that know nothing of LoRA.
func (v *AdapterEngine) SaveMerged(ctx context.Context, dir string) error {
	v.e.mu.RLock()
	defer v.e.mu.RUnlock()
	if v.e.closed {
		return ErrClosed
	}
	w := v.e.m.w.clone()
	foldLoRA(w, v.a.w)
	if err := writeCheckpoint(dir, &checkpoint{w: w, tok: v.e.tok, eos: v.e.eos}); err != nil {
		return fmt.Errorf("tiny: save merged adapter %q to %s: %w", v.a.name, dir, err)
	}
	return nil
}

// MergeAdapter writes the PEFT LoRA folder adapterDir folded into its base model as a plain
// Hugging Face folder in out. base is the base model (a folder or builtin:NAME); "" takes the
// adapter's base_model_name_or_path.
func MergeAdapter(ctx context.Context, adapterDir, base, out string, o Options) error {
	cj, err := os.ReadFile(filepath.Join(adapterDir, fileAdapterConfig))
	if err != nil {
		return fmt.Errorf("%s is not a LoRA adapter folder: %w", adapterDir, err)
	}
	var pc peftConfig
	if err := json.Unmarshal(cj, &pc); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(adapterDir, fileAdapterConfig), err)
	}
	if base == "" {
		base = pc.BaseModelNameOrPath
	}
	if base == "" {
		return fmt.Errorf("%s names no base model (base_model_name_or_path); give the base", filepath.Join(adapterDir, fileAdapterConfig))
	}
	e, err := Open(base, o)
	if err != nil {
		return fmt.Errorf("the base model %s: %w", base, err)
	}
	defer e.Close()
	c := LoRAConfig{Rank: pc.R, Alpha: pc.LoraAlpha, Targets: pc.TargetModules}
	if err := e.AddAdapter("merge", c, 0); err != nil {
		return fmt.Errorf("%s: %w", adapterDir, err)
	}
	v, err := e.Adapter("merge")
	if err != nil {
		return err
	}
	if err := v.Load(ctx, adapterDir); err != nil {
		return err
	}
	return v.SaveMerged(ctx, out)
}

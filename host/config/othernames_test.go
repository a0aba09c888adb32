package config

import (
	"strings"
	"testing"
)

// train.learning_rate is Hugging Face's name of lr: it passes through to the engine untouched,
// so the run trains at the default rate; the warning names lr although the two are letters
// apart (issue 35).
func TestOtherFrameworksNamesAreWarned(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: p\n    hf_checkpoint: builtin:tiny-arith\n    train: {learning_rate: 1.0e-3, max_grad_norm: 1.0}\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	got := strings.Join(c.Warnings, "\n")
	for _, want := range []string{
		"policies[0].train.learning_rate: passed through to the engine as it is not a key slimen reads; did you mean lr?",
		"policies[0].train.max_grad_norm: passed through to the engine as it is not a key slimen reads; did you mean clip_grad?",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("warnings:\n%s\nwant %q", got, want)
		}
	}
}

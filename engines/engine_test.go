package engines

import (
	"math"
	"strings"
	"testing"
)

// TestCheck: the one validation of a request's sampling settings; nothing is defaulted but top_p's
// protocol zero.
func TestCheck(t *testing.T) {
	ok := GenerateRequest{N: 2, Sampling: Sampling{MaxTokens: 8, Temperature: 1, TopP: 0.9}}
	if err := ok.Check(); err != nil {
		t.Fatalf("valid request refused: %v", err)
	}
	for _, c := range []struct {
		edit func(*GenerateRequest)
		want string
	}{
		{func(r *GenerateRequest) { r.N = -1 }, "n = -1"},
		{func(r *GenerateRequest) { r.MaxTokens = 0 }, "max_tokens = 0"},
		{func(r *GenerateRequest) { r.Temperature = -0.5 }, "temperature -0.5"},
		{func(r *GenerateRequest) { r.Temperature = math.NaN() }, "temperature NaN"},
		{func(r *GenerateRequest) { r.Temperature = math.Inf(1) }, "temperature +Inf"},
		{func(r *GenerateRequest) { r.TopP = 1.5 }, "top_p 1.5"},
		{func(r *GenerateRequest) { r.TopP = math.NaN() }, "top_p NaN"},
	} {
		r := ok
		c.edit(&r)
		if err := r.Check(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Check() = %v, want an error containing %q", err, c.want)
		}
	}
	if s := NormalizeSampling(Sampling{MaxTokens: 3}); s.TopP != 1 || s.MaxTokens != 3 {
		t.Errorf("NormalizeSampling = %+v; want top_p 1 and max_tokens kept", s)
	}
}

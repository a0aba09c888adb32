package host

import (
	"context"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// onGPU is an engine that says what its GPU holds (as a torch worker placed by NVML does).
type onGPU struct {
	*scripted.Engine
	m map[string]float64
}

func (e onGPU) DeviceMetrics() map[string]float64 { return e.m }

// A policy whose engine has device numbers gets them in its line of every step; one whose engine
// has none (or says nothing, as without NVML) has no such keys, not zeros.
func TestDeviceMetricsJoinThePolicyLine(t *testing.T) {
	gpu := onGPU{scripted.New(answerLastChar), map[string]float64{"gpu_mem_gib": 3.5, "gpu_used_gib": 10, "gpu_util": 42}}
	quiet := onGPU{scripted.New(answerLastChar), nil}
	r := loadRun(t, `
def rollout(task):
    for p in ["p", "q", "s"]:
        c = generate(p, task.prompt)
        reward(c, 1.0)
        train(c)
`, testConfig(2, "p", "q", "s"), map[string]engines.Engine{"p": gpu, "q": scripted.New(answerLastChar), "s": quiet}, numberedTasks(2))
	res, err := r.Step(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range res.Policies {
		for _, k := range []string{"gpu_mem_gib", "gpu_used_gib", "gpu_util"} {
			v, has := m[k]
			if m.Policy() == "p" && v != gpu.m[k] {
				t.Errorf("policy p: %s = %v, want %v", k, v, gpu.m[k])
			}
			if m.Policy() != "p" && has {
				t.Errorf("policy %s: %s = %v, want no such key", m.Policy(), k, v)
			}
		}
	}
	if WithoutTimings(`{"step":1,"policy":"p","gpu_mem_gib":3.5,"gpu_used_gib":10,"gpu_util":42,"loss":1}`) != `{"step":1,"policy":"p","loss":1}` {
		t.Error("WithoutTimings keeps the GPU numbers, which differ between equal runs")
	}
}

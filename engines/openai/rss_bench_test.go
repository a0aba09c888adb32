package openai

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// peakRSS is the process's peak resident set (VmHWM) in bytes; resetPeakRSS starts it again
// from the current resident set (Linux: clear_refs 5).
func peakRSS(b *testing.B) int64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		b.Skip("no /proc/self/status: peak RSS is measured on Linux")
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	b.Skip("no VmHWM in /proc/self/status")
	return 0
}

func resetPeakRSS(b *testing.B) {
	runtime.GC()
	debug.FreeOSMemory()
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		b.Skipf("cannot reset the peak RSS: %v", err)
	}
}

// BenchmarkFrontPeakRSS measures the process's peak resident memory while the front of the tiny
// engine (builtin:tiny-arith, one thread) answers "200-concurrent": 200 chat requests at once
// (max_tokens 32), and "2000x128": one /v1/completions request of 2,000 prompts × n = 128 with
// the default max_tokens, the request that took a server from 0.49 to 5.27 GB (issue 36); the
// same with max_tokens 2 (256,000 short samples: refused by the samples cap, which took 3.1 GB
// when only tokens were counted); and "32x128-max_tokens-32", a request at the default caps
// (4,096 samples). It
// reports the peak before the requests (base-MB) and during them (peak-MB), and the statuses.
//
//	go test ./engines/openai -run '^$' -bench FrontPeakRSS -benchtime 1x
func BenchmarkFrontPeakRSS(b *testing.B) {
	base := front(b, openTiny(b), HandlerOptions{})
	do := func(path, body string) int {
		resp, err := http.Post(base+path, "application/json", strings.NewReader(body))
		if err != nil {
			b.Error(err)
			return 0
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	var prompts []string
	for i := range 2000 {
		prompts = append(prompts, fmt.Sprintf("%q", fmt.Sprint(i%97, "+", i%89, "=")))
	}
	big := `{"prompt":[` + strings.Join(prompts, ",") + `],"n":128}`
	short := `{"prompt":[` + strings.Join(prompts, ",") + `],"n":128,"max_tokens":2}`
	atCap := `{"prompt":[` + strings.Join(prompts[:32], ",") + `],"n":128,"max_tokens":32}`
	for _, tc := range []struct {
		name string
		run  func() map[int]int
	}{
		{"200-concurrent", func() map[int]int {
			var mu sync.Mutex
			var wg sync.WaitGroup
			statuses := map[int]int{}
			for i := range 200 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					s := do("/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":"%d+%d="}],"max_tokens":32,"seed":%d}`, i, i, i))
					mu.Lock()
					statuses[s]++
					mu.Unlock()
				}()
			}
			wg.Wait()
			return statuses
		}},
		{"2000x128", func() map[int]int { return map[int]int{do("/completions", big): 1} }},
		{"2000x128-max_tokens-2", func() map[int]int { return map[int]int{do("/completions", short): 1} }},
		{"32x128-max_tokens-32", func() map[int]int { return map[int]int{do("/completions", atCap): 1} }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var statuses map[int]int
			resetPeakRSS(b)
			before := peakRSS(b)
			for b.Loop() {
				statuses = tc.run()
			}
			b.ReportMetric(float64(before)/(1<<20), "base-MB")
			b.ReportMetric(float64(peakRSS(b))/(1<<20), "peak-MB")
			b.Logf("statuses %v (%d bytes of body for 2000x128)", statuses, len(big))
		})
	}
}

package tiny

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/slimen/slimen/host/tasks"
)

// agentTexts renders n examples of the synthetic:calc agent corpus (calculator calls, tool
// results, arithmetic, MemAgent memories over synthetic:facts documents) with the chat template,
// each followed by its response: the kind of text a chat vocabulary is trained on.
func agentTexts(tb testing.TB, n int) ([]string, int) {
	c := tasks.Calc{Seed: 1}
	texts, size := make([]string, n), 0
	for i := range texts {
		ctxMsgs, resp := c.AgentExample(i)
		s, err := QwenChatText(ctxMsgs, nil, true)
		if err != nil {
			tb.Fatal(err)
		}
		texts[i] = s + resp
		size += len(texts[i])
	}
	return texts, size
}

// repoTexts is the Go and Markdown files of this repository, up to max bytes: a few MB of varied
// text (code, prose, tables) to time TrainBPE on a vocabulary far larger than the synthetic
// corpus's hundred-odd words.
func repoTexts(tb testing.TB, max int) ([]string, int) {
	var texts []string
	size := 0
	err := filepath.WalkDir(filepath.Join("..", ".."), func(path string, d fs.DirEntry, err error) error {
		if err != nil || size >= max {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if ext := filepath.Ext(path); !d.IsDir() && (ext == ".go" || ext == ".md") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			texts = append(texts, string(b))
			size += len(b)
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	return texts, size
}

// BenchmarkTrainBPE trains a 4,096-token vocabulary on the agent corpus (2.9 MB; its hundred-odd
// distinct words are all merged well before 4,096) and on 4 MB of this repository's Go and
// Markdown files:
//
//	go test ./engines/tiny -run '^$' -bench TrainBPE -benchtime 1x
func BenchmarkTrainBPE(b *testing.B) {
	for _, c := range []struct {
		name  string
		texts func() ([]string, int)
	}{
		{"agent", func() ([]string, int) { return agentTexts(b, 16000) }},
		{"repo", func() ([]string, int) { return repoTexts(b, 4<<20) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			texts, size := c.texts()
			b.SetBytes(int64(size))
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				tok, err := TrainBPE(texts, 4096, ChatSpecials)
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(size)/1e6, "MB")
				b.ReportMetric(time.Since(start).Seconds(), "s/train")
				b.ReportMetric(float64(tok.VocabSize()), "tokens")
			}
		})
	}
}

// BenchmarkEncodeBPE encodes with a 4,096-token vocabulary on one goroutine (tokens/s and MB/s):
// the agent corpus with the vocabulary trained on it, and this repository's files with one
// trained on them.
//
//	go test ./engines/tiny -run '^$' -bench EncodeBPE
func BenchmarkEncodeBPE(b *testing.B) {
	for _, c := range []struct {
		name  string
		texts func() ([]string, int)
	}{
		{"agent", func() ([]string, int) { return agentTexts(b, 2000) }},
		{"repo", func() ([]string, int) { return repoTexts(b, 1<<20) }},
	} {
		b.Run(c.name, func(b *testing.B) {
			texts, size := c.texts()
			tok, err := TrainBPE(texts, 4096, ChatSpecials)
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(size))
			b.ResetTimer()
			n := 0
			for range b.N {
				for _, s := range texts {
					n += len(tok.Encode(s))
				}
			}
			b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "tokens/s")
			b.ReportMetric(float64(size)/float64(n/b.N), "bytes/token")
		})
	}
}

package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The docs' scripts run (issue 35: agents.md's first snippet used boxed, CALC and run_tool
// undefined). Every ```python block of README.md and docs/*.md is one of:
//
//   - a whole script, which defines rollout: run for a step of two tasks with `slimen exec --steps
//     1 --batch-size 2` on zero-config policies, and it must end with status 0 and no failed
//     rollout;
//   - tagged ```python check: a whole script that needs what a test cannot have (a chat model's
//     context, a program beside it): `slimen check` must pass it;
//   - tagged ```python fragment: a part of a script, a call's signature or a program in another
//     language, not run.
//
// A block that is none of these fails the test, which names its place.

// docBlock is one fenced ```python block of a doc.
type docBlock struct {
	place string   // file:line of its opening fence
	tags  []string // the words after "python" in the fence
	src   string
}

func (b docBlock) tagged(tag string) bool {
	for _, t := range b.tags {
		if t == tag {
			return true
		}
	}
	return false
}

// pythonBlocks returns the ```python blocks of a markdown file.
func pythonBlocks(t *testing.T, file string) []docBlock {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(data), "\n")
	var out []docBlock
	for i := 0; i < len(lines); i++ {
		// An opening fence is a run of backticks and an info string without one (CommonMark):
		// "```` ```mermaid ````" is inline code, not a fence. It closes at a line of as many
		// backticks or more.
		line := strings.TrimSpace(lines[i])
		ticks := len(line) - len(strings.TrimLeft(line, "`"))
		if ticks < 3 || strings.Contains(line[ticks:], "`") {
			continue
		}
		info := strings.Fields(line[ticks:])
		start := i
		var body []string
		for i++; i < len(lines); i++ {
			l := strings.TrimSpace(lines[i])
			if len(l) >= ticks && strings.Trim(l, "`") == "" {
				break
			}
			body = append(body, lines[i])
		}
		if i == len(lines) {
			t.Errorf("%s:%d: a code block that is never closed", file, start+1)
		}
		if len(info) > 0 && info[0] == "python" {
			out = append(out, docBlock{place: fmt.Sprintf("%s:%d", file, start+1), tags: info[1:], src: strings.Join(body, "\n") + "\n"})
		}
	}
	return out
}

func TestDocScriptsRun(t *testing.T) {
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	files = append([]string{"../../README.md"}, files...)
	ran := 0
	for _, f := range files {
		for _, b := range pythonBlocks(t, f) {
			place := strings.TrimPrefix(b.place, "../../")
			for _, tag := range b.tags {
				if tag != "check" && tag != "fragment" {
					t.Errorf("%s: ```python %s: unknown tag %q (known: check, fragment)", place, strings.Join(b.tags, " "), tag)
				}
			}
			if b.tagged("fragment") {
				continue
			}
			if !strings.Contains(b.src, "def rollout(") {
				t.Errorf("%s: the block defines no rollout: make it a whole script, or tag it ```python fragment if it is a part of one", place)
				continue
			}
			ran++
			t.Run(place, func(t *testing.T) {
				dir := t.TempDir()
				script := filepath.Join(dir, "snippet.star")
				if err := os.WriteFile(script, []byte(b.src), 0o644); err != nil {
					t.Fatal(err)
				}
				args := []string{"exec", script, "--steps", "1", "--batch-size", "2", "--out", filepath.Join(dir, "run")}
				if b.tagged("check") {
					args = []string{"check", script}
				}
				out, err := slimen(t, nil, args...)
				if code := exitCode(t, err); code != 0 {
					t.Fatalf("slimen %s: status %d; the block at %s does not run:\n%s", args[0], code, place, out)
				}
				if b.tagged("check") {
					return
				}
				metrics, err := os.ReadFile(filepath.Join(dir, "run", "metrics.jsonl"))
				if err != nil {
					t.Fatalf("the run wrote no metrics: %v\n%s", err, out)
				}
				for _, line := range strings.Split(strings.TrimSpace(string(metrics)), "\n") {
					var m struct {
						Policy string  `json:"policy"`
						Failed float64 `json:"failed"`
					}
					if err := json.Unmarshal([]byte(line), &m); err != nil {
						t.Fatalf("metrics.jsonl: %v: %s", err, line)
					}
					if m.Policy == "_run" && m.Failed > 0 {
						t.Errorf("the block at %s ran with %v failed rollouts:\n%s", place, m.Failed, out)
					}
				}
			})
		}
	}
	if ran == 0 {
		t.Error("no runnable script found in README.md and docs/*.md")
	}
}

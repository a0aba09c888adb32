package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/starlib"
)

// `slimen serve --openai` answers the OpenAI API with exactly what the tiny engine samples
// in-process (the openai engine kind as the client), requires the token, and stops on SIGTERM.
func TestServeOpenAI(t *testing.T) {
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	cmd := exec.Command(slimenBin, "serve", "--model", remoteModel, "--threads", "1", "--listen", grpcAddr,
		"--openai", httpAddr, "--token-env", "SLIMEN_TEST_KEY")
	cmd.Env = append(os.Environ(), "SLIMEN_TEST_KEY=sk-serve")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.Dial("tcp", httpAddr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slimen serve --openai %s did not come up", httpAddr)
		}
	}
	ctx := context.Background()
	base := "http://" + httpAddr + "/v1"
	if _, err := openai.Open(ctx, openai.Options{BaseURL: base, Model: remoteModel}); err == nil {
		t.Fatal("a client without the token was served")
	}
	c, err := openai.Open(ctx, openai.Options{BaseURL: base, Model: remoteModel, APIKey: "sk-serve"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	local, err := tiny.Open(remoteModel, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	reqs := []engines.GenerateRequest{
		{ID: "a", Messages: []engines.Message{{Role: "user", Content: "What is 17+25?"}}, N: 2, Sampling: engines.Sampling{MaxTokens: 16, Temperature: 1, Seed: 3}},
		{ID: "b", PromptTokens: local.Tokenizer().Encode("<|user|>8*7=<|end|><|assistant|>"), Sampling: engines.Sampling{MaxTokens: 16, Seed: 4}},
	}
	want, err := local.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("through slimen serve --openai:\n%+v\nin-process:\n%+v", got, want)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("slimen serve after SIGTERM: %v", err)
	}
}

// `slimen serve --config C --policy P --openai` serves the engine of a run config's policy, of
// any kind a run opens: here a remote engine (another `slimen serve`), whose samples come back
// through the OpenAI API exactly as the tiny engine makes them in-process.
func TestServeOpenAIRemote(t *testing.T) {
	backend := freeAddr(t)
	startServe(t, remoteModel, backend, t.TempDir())
	cfgFile := filepath.Join(t.TempDir(), "serve.yaml")
	cfg := fmt.Sprintf("policies:\n  - {name: judge, trainable: false, engine: {kind: remote, address: %q}}\n  - {name: other, engine: {kind: tiny}}\n", backend)
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(slimenBin, "serve", "--config", cfgFile, "--listen", freeAddr(t)).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "defines 2 policies; name the one to serve with --policy") {
		t.Fatalf("two policies and no --policy: %v\n%s", err, out)
	}
	httpAddr := freeAddr(t)
	cmd := exec.Command(slimenBin, "serve", "--config", cfgFile, "--policy", "judge", "--listen", freeAddr(t), "--openai", httpAddr)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	ctx := context.Background()
	var c *openai.Engine
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err = openai.Open(ctx, openai.Options{BaseURL: "http://" + httpAddr + "/v1", Model: remoteModel}); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slimen serve --config --openai %s did not come up: %v", httpAddr, err)
		}
	}
	defer c.Close()
	local, err := tiny.Open(remoteModel, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	reqs := []engines.GenerateRequest{{ID: "a", Messages: []engines.Message{{Role: "user", Content: "What is 17+25?"}}, N: 2,
		Sampling: engines.Sampling{MaxTokens: 16, Temperature: 1, Seed: 3}}}
	want, err := local.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Generate(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("through a remote engine served by slimen serve --config --openai:\n%+v\nin-process:\n%+v", got, want)
	}
	// Requests may name the served policy instead of its model.
	byPolicy, err := openai.Open(ctx, openai.Options{BaseURL: "http://" + httpAddr + "/v1", Model: "judge"})
	if err != nil {
		t.Fatal(err)
	}
	defer byPolicy.Close()
	if got, err := byPolicy.Generate(ctx, reqs); err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("naming the policy: %v, %+v; want %+v", err, got, want)
	}
}

// The OpenAI front of `slimen serve` times out slow headers and idle keep-alive connections, and
// takes tools for the tiny engine (its template has no tools variable) by describing them in the
// system message, as agent()'s tools_prompt="system" does.
func TestServeOpenAIServerSettings(t *testing.T) {
	eng, err := tiny.Open(remoteModel, tiny.Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	hs, err := serveOpenAI(eng, l, server.Options{}, openaiLimits{}, errc)
	if err != nil {
		t.Fatal(err)
	}
	defer hs.Close()
	if hs.ReadHeaderTimeout <= 0 || hs.IdleTimeout <= 0 {
		t.Errorf("header timeout %s, idle timeout %s: want both", hs.ReadHeaderTimeout, hs.IdleTimeout)
	}
	resp, err := http.Post("http://"+l.Addr().String()+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"messages":[{"role":"user","content":"12*34?"}],"max_tokens":4,"return_token_ids":true,"tools":[{"type":"function","function":{"name":"calc"}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := fmt.Sprint(eng.Tokenizer().EncodeChat([]engines.Message{{Role: "system", Content: starlib.ToolsSystemPrompt([]string{`{"type":"function","function":{"name":"calc"}}`})}, {Role: "user", Content: "12*34?"}}, true))
	var r struct {
		PromptTokenIDs []int32 `json:"prompt_token_ids"`
	}
	if resp.StatusCode != 200 || json.Unmarshal(body, &r) != nil || fmt.Sprint(r.PromptTokenIDs) != want {
		t.Errorf("tools on the tiny engine: %d %s; want the prompt %s", resp.StatusCode, body, want)
	}
}

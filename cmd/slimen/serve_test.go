package main

import (
	"bufio"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines/remote"
)

// Off loopback, `slimen serve` refuses to start unless it can tell its clients apart from anyone
// else on the network: a token, or client certificates. Plaintext or TLS alone is not enough.
func TestServeOffLoopbackNeedsAuthentication(t *testing.T) {
	for _, args := range [][]string{
		{"--listen", "0.0.0.0:0", "--insecure"},
		{"--listen", ":0", "--insecure"},
	} {
		out, err := slimen(t, nil, append([]string{"serve"}, args...)...)
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(out, "must authenticate its clients") ||
			!strings.Contains(out, "--token-env VAR") || !strings.Contains(out, "--tls-client-ca") {
			t.Errorf("slimen serve %s: %v\n%s\nwant exit 2 and a refusal that names --token-env and --tls-client-ca", strings.Join(args, " "), err, out)
		}
	}
	// With a token it serves, and says where clients may save and load.
	root := t.TempDir()
	cmd := exec.Command(slimenBin, "serve", "--listen", "0.0.0.0:0", "--insecure", "--token-env", "SERVE_TEST_TOKEN", "--root", root)
	cmd.Env = append(os.Environ(), "SERVE_TEST_TOKEN=s3cret")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	real, _ := filepath.EvalSymlinks(root)
	sc := bufio.NewScanner(stderr)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "serving tiny engine") {
			if !strings.Contains(sc.Text(), "token from $SERVE_TEST_TOKEN") || !strings.Contains(sc.Text(), "save and load model folders only under "+real) {
				t.Errorf("the start-up line does not name the token and the root %s: %s", real, sc.Text())
			}
			return
		}
	}
	t.Fatal("slimen serve with a token did not start")
}

// A client of `slimen serve --root R` can save and load model folders under R only: parent
// references, absolute paths elsewhere and symbolic links out of R are refused, and nothing is
// written outside R.
func TestServeConfinesSaveAndLoad(t *testing.T) {
	base := t.TempDir()
	root, outside := filepath.Join(base, "root"), filepath.Join(base, "outside")
	os.MkdirAll(root, 0o755)
	os.MkdirAll(outside, 0o755)
	if err := os.Symlink(outside, filepath.Join(root, "escape")); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	startServe(t, remoteModel, addr, root)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := remote.Dial(ctx, remote.Options{Address: addr})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	real, _ := filepath.EvalSymlinks(root)
	for _, dir := range []string{"../outside/m", filepath.Join(outside, "m"), "escape/m", "/etc"} {
		if err := c.Save(ctx, dir); err == nil || !strings.Contains(err.Error(), "outside this server's root "+real) {
			t.Errorf("save %q: got %v, want a refusal naming the root", dir, err)
		}
		if err := c.Load(ctx, dir); err == nil || !strings.Contains(err.Error(), "outside this server's root "+real) {
			t.Errorf("load %q: got %v, want a refusal naming the root", dir, err)
		}
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("the hostile saves wrote %d entries outside the root", len(entries))
	}
	if err := c.Save(ctx, "model"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "model", "config.json")); err != nil {
		t.Errorf("a save inside the root: %v", err)
	}
	if err := c.Load(ctx, filepath.Join(root, "model")); err != nil {
		t.Errorf("a load inside the root: %v", err)
	}
}

// A run whose checkpoints lie outside its engine servers' root stops at start-up, before its
// first step, with an error that says so (the servers are asked; it used to be the first
// checkpoint, after the training).
func TestRemoteCheckpointOutsideTheServersRoot(t *testing.T) {
	rr := remoteConfigs(t, 2, 2, "save_interval: 1", "")
	elsewhere := t.TempDir()
	startServe(t, remoteModel, rr.addrs[0], elsewhere)
	startServe(t, remoteModel, rr.addrs[1], elsewhere)
	out := filepath.Join(rr.runs, "run")
	log, err := slimen(t, nil, "exec", "examples/debate/debate.star", "--config", rr.remote, "--out", out)
	real, _ := filepath.EvalSymlinks(elsewhere)
	if err == nil || !strings.Contains(log, "would refuse to write the run's checkpoints ("+filepath.Join(out, "checkpoints")+")") || strings.Contains(log, "step 1") ||
		!strings.Contains(log, "outside this server's root "+real) || !strings.Contains(log, "--root") {
		t.Errorf("a run checkpointing outside the servers' root: %v\n%s", err, log)
	}
}

package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"image/png"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/tasks"
	"github.com/slimen/slimen/host/view"
)

// viewScript is a small debate in chats: the generator answers, a critic answers after seeing
// it, the generator answers again after reading the critic (a two-turn conversation with the
// critic's words injected between the turns); the rollout of task FAIL fails after its calls.
const viewScript = `
load("@slimen//answers.star", "boxed", "equal")

def rollout(task):
    g = chat("generator", system = "Answer with \\boxed{}.")
    g.user(task.prompt)
    first = g.generate(max_tokens = 12)
    c = chat("critic")
    c.user("Problem: " + task.prompt + "\nA first answer: " + first.text + "\nYour answer?")
    crit = c.generate(max_tokens = 12)
    g.user("A critic says " + crit.text + ". Your final answer?")
    g.generate(max_tokens = 12)
    if task.id == FAIL:
        check_answer(task)
    for chat_, text in [(g, g.turns[-1].text), (c, crit.text)]:
        reward(chat_, 1.0 if equal(boxed(text), task.label) else 0.0)
        train(chat_)

def check_answer(task):
    fail("the checker of task %s fails on purpose" % task.id)
`

// viewRun runs viewScript for two steps of four tasks on the embedded engine into a run folder,
// and returns the folder and the id of the task whose rollout failed.
func viewRun(t *testing.T) (dir, failed string) {
	t.Helper()
	// REINFORCE++ normalises advantages over the batch: a group of one conversation a task still
	// gets advantages of both signs, which the page colours.
	cfg := config.Default([]string{"generator", "critic"})
	for i := range cfg.Policies {
		cfg.Policies[i].Train.AdvantageEstimator = "reinforce_plus_plus"
	}
	cfg.Rollout.BatchSize = 4
	cfg.Run.Steps = 2
	cfg.Run.SaveMinutes = 0
	cfg.Run.EvalInterval = 1
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "arith", Path: "synthetic:arith", InputKey: "prompt", LabelKey: "label", Limit: 4, NSamples: 1, TopP: 1, MaxResponseLen: 32}}
	src, err := tasks.Open(cfg.Data.Path, tasks.Options{Seed: cfg.Run.Seed})
	if err != nil {
		t.Fatal(err)
	}
	failed = src.Task(1).ID
	dir = filepath.Join(t.TempDir(), "debate")
	script := filepath.Join(t.TempDir(), "debate.star")
	if err := os.WriteFile(script, []byte(strings.Replace(viewScript, "FAIL", fmt.Sprintf("%q", failed), 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	r, err := host.Load(ctx, script, host.Options{Config: cfg, Out: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Train(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	return dir, failed
}

// chromium is the headless browser's binary, or "" where there is none (CI may not have one).
func chromium() string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// TestViewInBrowser shows a real run's page in headless Chromium: screenshots of the curves and of
// the rollout browser (left in /tmp/view-shots for a person to look at), and the DOM after the
// page's scripts ran, which must hold the conversations' text, token spans with their loss-mask
// classes and the failed rollout with its backtrace. Skipped without a Chromium binary.
func TestViewInBrowser(t *testing.T) {
	bin := chromium()
	if bin == "" {
		t.Skip("no chromium binary (apt-get install chromium)")
	}
	dir, failed := viewRun(t)
	srv, err := view.New(dir, view.Options{Graph: func(ctx context.Context) (view.Drawing, error) { return runGraph(ctx, dir) }})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	l, err := view.Listen("127.0.0.1:0", view.Options{})
	if err != nil {
		t.Fatal(err)
	}
	// grow, once set, is called at the page's third poll of the rollouts: a run going on under
	// an open page.
	var (
		mu    sync.Mutex
		grow  func()
		polls int
	)
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		if r.URL.Path == "/api/rollouts" && grow != nil {
			if polls++; polls == 3 {
				grow()
			}
		}
		mu.Unlock()
		srv.ServeHTTP(w, r)
	})}
	go hs.Serve(l)
	defer hs.Close()
	base := "http://" + l.Addr().String() + "/"

	shots := filepath.Join(os.TempDir(), "view-shots")
	if err := os.MkdirAll(shots, 0o755); err != nil {
		t.Fatal(err)
	}
	browse := func(args ...string) []byte {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		all := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--user-data-dir=" + t.TempDir(),
			"--virtual-time-budget=8000"}, args...)
		var out, stderr bytes.Buffer
		cmd := exec.CommandContext(ctx, bin, all...)
		cmd.Stdout, cmd.Stderr = &out, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("%s %s: %v\n%s", bin, strings.Join(args, " "), err, stderr.String())
		}
		return out.Bytes()
	}
	for _, shot := range []struct{ name, query, size string }{
		{"curves", "?only=curves,topology", "1280,1100"},
		{"rollouts", "?only=rollouts&kind=train", "1280,1800"},
		{"failed", "?only=rollouts&status=failed", "1280,1000"},
	} {
		path := filepath.Join(shots, shot.name+".png")
		os.Remove(path)
		browse("--screenshot="+path, "--window-size="+shot.size, base+shot.query)
		checkScreenshot(t, path)
	}

	dom := string(browse("--dump-dom", "--window-size=1280,1600", base))
	for _, want := range []string{
		"A critic says",                    // a message injected into the generator's conversation
		"Problem: ",                        // the critic's prompt
		`class="tok m1`,                    // a trained token
		`class="tok m0"`,                   // an injected one
		"advantage",                        // the numbers of a token, for its tooltip
		"the checker of task " + failed,    // the failed rollout's error
		"in check_answer",                  // with its backtrace
		"turn 2",                           // the generator's second turn, a row of its own
		"step 2 · finished",                // the run's state, from events.log
		`<polyline class="curve"`,          // a curve
		"dataflow of one rollout of debat", // the topology
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("the page's DOM lacks %q", want)
		}
	}
	// A policy has the colour the dataflow drawing gives it (the generator, first, the first).
	if !regexp.MustCompile(`--pc: ?#0072b2;?"><div class="call-head"><span class="policy">generator<`).MatchString(dom) {
		t.Errorf("the generator's calls are not in the drawing's first colour")
	}
	if n := len(regexp.MustCompile(`class="rollout( failed)?"`).FindAllString(dom, -1)); n < 4 {
		t.Errorf("the page shows %d rollouts, want at least 4", n)
	}

	// Live: steps written while the page is open appear without a reload — the curves' last
	// step, the new rollout first in the browser — with a line being written left for later.
	mu.Lock()
	grow = func() {
		appendFile(t, filepath.Join(dir, "metrics.jsonl"), `{"step":3,"policy":"generator","reward_mean":0.75}`+"\n"+`{"step":3,"policy":"_run","accuracy":0.5}`+"\n"+`{"step":4,"policy":"gen`)
		appendFile(t, filepath.Join(dir, "rollouts.jsonl"), `{"step":3,"eval":false,"index":0,"task":{"id":"live-1","prompt":"LIVE-STEP-3 question","label":"1"},"group":"live-1","result":"None",`+
			`"calls":[{"policy":"generator","kind":"generate","id":"live-1/0#0","prompt":"LIVE-STEP-3 question","prompt_tokens":4,"response":"\\boxed{1}","finish_reason":"stop","reward":1,"trained":true,`+
			`"token_ids":[5,6],"pieces":["LIVE-","ANSWER"],"mask":[1,1],"advantage":[0.5,0.5],"logprob":[-0.1,-0.2]}]}`+"\n")
	}
	mu.Unlock()
	live := string(browse("--dump-dom", "--window-size=1280,1600", base))
	mu.Lock()
	if polls < 4 {
		t.Errorf("the page polled the rollouts %d times in its virtual 8 s, want at least 4", polls)
	}
	mu.Unlock()
	for _, want := range []string{"LIVE-STEP-3 question", ">LIVE-</span>", "step 3 ·"} {
		if !strings.Contains(live, want) {
			t.Errorf("after the run grew under the open page, its DOM lacks %q", want)
		}
	}

	if t.Failed() {
		os.WriteFile(filepath.Join(shots, "dom.html"), []byte(dom), 0o644)
		os.WriteFile(filepath.Join(shots, "dom-live.html"), []byte(live), 0o644)
		t.Logf("the DOM is in %s", filepath.Join(shots, "dom.html"))
	}
}

// checkScreenshot fails unless path is a PNG with something drawn on it: many colours, not a
// blank or an error page.
func checkScreenshot(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	colors := map[[3]uint32]bool{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y += 3 {
		for x := b.Min.X; x < b.Max.X; x += 3 {
			r, g, bl, _ := img.At(x, y).RGBA()
			colors[[3]uint32{r >> 8, g >> 8, bl >> 8}] = true
		}
	}
	if b.Dx() < 1000 || len(colors) < 100 {
		t.Errorf("%s: %dx%d with %d colours; want a drawn page", path, b.Dx(), b.Dy(), len(colors))
	}
}

// TestViewCommand: slimen view refuses a missing folder, a folder no run wrote, and an address off
// loopback without a token, each naming what is wrong; it prints the address it serves on (a
// free loopback port by default), answers there, asks for the token off loopback, and stops on
// SIGTERM with status 0.
func TestViewCommand(t *testing.T) {
	tmp := t.TempDir()
	run := filepath.Join(tmp, "run")
	if err := os.MkdirAll(run, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(run, "metrics.jsonl"), []byte(`{"step":1,"policy":"solver","reward_mean":0.5}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		env  []string
		want string
	}{
		{[]string{"view", filepath.Join(tmp, "gone")}, nil, "slimen view: " + filepath.Join(tmp, "gone") + ": no such run folder"},
		{[]string{"view", tmp}, nil, "slimen view: " + tmp + " is not a run folder: it has none of events.log, metrics.jsonl, config.yaml"},
		{[]string{"view", run, "--listen", "0.0.0.0:0"}, nil, "listen address 0.0.0.0:0 is not loopback"},
		{[]string{"view", run, "--token-env", "SLIMEN_VIEW_NO_TOKEN"}, []string{"SLIMEN_VIEW_NO_TOKEN="}, "--token-env SLIMEN_VIEW_NO_TOKEN: the environment variable is empty or unset"},
		{[]string{"view"}, nil, "usage: slimen view RUN_DIR"},
	} {
		out, err := slimen(t, tc.env, tc.args...)
		if code := exitCode(t, err); code != 2 || !strings.Contains(out, tc.want) {
			t.Errorf("slimen %s: status %d, %q; want 2 and %q", strings.Join(tc.args, " "), code, out, tc.want)
		}
	}

	serve := func(env []string, args ...string) (url string, stop func() int) {
		t.Helper()
		cmd := exec.Command(slimenBin, append([]string{"view", run}, args...)...)
		cmd.Env = append(os.Environ(), env...)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("slimen view printed no address: %v\n%s", err, stderr.String())
		}
		return strings.TrimSpace(line), func() int {
			cmd.Process.Signal(syscall.SIGTERM)
			return exitCode(t, cmd.Wait())
		}
	}
	status := func(url string, hdr ...string) int {
		req, err := http.NewRequest("GET", url, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(hdr) == 2 {
			req.Header.Set(hdr[0], hdr[1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}

	url, stop := serve(nil)
	if !regexp.MustCompile(`^http://127\.0\.0\.1:[1-9][0-9]*/$`).MatchString(url) {
		t.Errorf("the address printed: %q, want a free port on 127.0.0.1", url)
	}
	if code := status(url + "api/curves"); code != 200 {
		t.Errorf("GET api/curves: %d", code)
	}
	if code := stop(); code != 0 {
		t.Errorf("after SIGTERM: status %d, want 0", code)
	}

	url, stop = serve([]string{"SLIMEN_VIEW_TOKEN=tok3n"}, "--listen", "0.0.0.0:0", "--token-env", "SLIMEN_VIEW_TOKEN")
	url = strings.Replace(url, "0.0.0.0", "127.0.0.1", 1)
	if code := status(url + "api/run"); code != 401 {
		t.Errorf("off loopback without the token: %d, want 401", code)
	}
	if code := status(url+"api/run", "Authorization", "Bearer tok3n"); code != 200 {
		t.Errorf("off loopback with the token: %d, want 200", code)
	}
	stop()
}

// TestViewGraphOfTheSavedScript: the page's topology comes from the run folder alone — the script
// version it kept with the module it loads, its config and a task from rollouts.jsonl — when the
// script's folder and the eval file the run read are gone.
func TestViewGraphOfTheSavedScript(t *testing.T) {
	src := t.TempDir()
	files := map[string]string{
		"main.star":  "load(\"lib.star\", \"ask\")\n\ndef rollout(task):\n    a = ask(\"solver\", task.prompt)\n    b = ask(\"checker\", \"Check: \" + a.text)\n    reward(a, 1.0)\n    train(a)\n",
		"lib.star":   "def ask(policy, prompt):\n    return generate(policy, prompt, max_tokens = 32)\n",
		"eval.jsonl": `{"prompt": "1 + 1 =", "label": "2"}` + "\n",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(src, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := config.Default([]string{"solver", "checker"})
	cfg.Rollout.BatchSize = 2
	cfg.Run.Steps = 1
	cfg.Run.SaveMinutes = 0
	cfg.Eval.Datasets = []config.EvalDataset{{Name: "held", Path: filepath.Join(src, "eval.jsonl"), InputKey: "prompt", LabelKey: "label", NSamples: 1, TopP: 1, MaxResponseLen: 8}}
	dir := filepath.Join(t.TempDir(), "run")
	ctx := context.Background()
	r, err := host.Load(ctx, filepath.Join(src, "main.star"), host.Options{Config: cfg, Out: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Train(ctx); err != nil {
		t.Fatal(err)
	}
	r.Close()
	if err := os.RemoveAll(src); err != nil {
		t.Fatal(err)
	}
	d, err := runGraph(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"solver", "checker", "main.star"} {
		if !strings.Contains(string(d.SVG), want) {
			t.Errorf("the SVG lacks %q", want)
		}
	}
	if !strings.Contains(d.Mermaid, "solver") || !strings.Contains(d.Mermaid, "-->") {
		t.Errorf("the Mermaid text: %s", d.Mermaid)
	}
	// The page colours policies as the drawing does: the solver, which feeds the checker, first.
	if !slices.Equal(d.Policies, []string{"solver", "checker"}) {
		t.Errorf("the policies in colour order: %v, want [solver checker]", d.Policies)
	}
	// A folder that keeps no script says so.
	empty := t.TempDir()
	if _, err := runGraph(ctx, empty); err == nil || !strings.Contains(err.Error(), filepath.Join(empty, "script.star")+": the run folder keeps no script to trace") {
		t.Errorf("a folder without a script: %v", err)
	}
}

func appendFile(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Error(err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Error(err)
	}
}

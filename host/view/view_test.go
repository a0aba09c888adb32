package view

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// rolloutLine is one line of rollouts.jsonl in the documented shape (docs/observability.md).
func rolloutLine(step, index int, eval, failed bool, rewards map[string]float64) string {
	rec := map[string]any{"step": step, "eval": eval, "index": index, "group": fmt.Sprintf("t%d", index),
		"task": map[string]any{"id": fmt.Sprintf("arith-%d", index), "prompt": fmt.Sprintf("What is %d + 1?", index), "label": fmt.Sprint(index + 1)}}
	if eval {
		rec["dataset"] = "arith"
	}
	if failed {
		rec["error"] = "fail: boom\nTraceback (most recent call last):\n  debate.star:12:5: in rollout"
	}
	var calls []any
	for _, p := range slices.Sorted(func(yield func(string) bool) {
		for p := range rewards {
			if !yield(p) {
				return
			}
		}
	}) {
		calls = append(calls, map[string]any{"policy": p, "kind": "generate", "id": "c", "prompt": "Q", "prompt_tokens": 3,
			"response": "\\boxed{2}", "finish_reason": "stop", "reward": rewards[p], "trained": true,
			"token_ids": []int{5, 6, 7}, "pieces": []string{"\\boxed{", "2", "}"}, "mask": []float64{1, 1, 0},
			"advantage": []float64{0.5, 0.5, 0}, "logprob": []float64{-0.1, -0.2, -0.3}})
	}
	rec["calls"] = calls
	b, err := json.Marshal(rec)
	if err != nil {
		panic(err)
	}
	return string(b) + "\n"
}

// fixtureRun writes a run folder: two policies over 4 steps, an eval, events.log, the config and
// script, and 3 rollouts a step (the second of step 3 failed).
func fixtureRun(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	var m strings.Builder
	m.WriteString(`{"step":0,"policy":"_eval","dataset":"arith","accuracy":0.25,"tasks":200}` + "\n")
	for s := 1; s <= 4; s++ {
		fmt.Fprintf(&m, `{"step":%d,"policy":"critic","reward_mean":%g,"loss":0.1}`+"\n", s, 0.1*float64(s))
		fmt.Fprintf(&m, `{"step":%d,"policy":"generator","reward_mean":%g,"loss":0.2}`+"\n", s, 0.2*float64(s))
		fmt.Fprintf(&m, `{"step":%d,"policy":"_run","accuracy":0.5}`+"\n", s)
	}
	var r strings.Builder
	for s := 1; s <= 4; s++ {
		for i := 0; i < 3; i++ {
			r.WriteString(rolloutLine(s, i, false, s == 3 && i == 1, map[string]float64{"generator": float64(i % 2), "critic": float64(s) / 4}))
		}
	}
	r.WriteString(rolloutLine(4, 0, true, false, map[string]float64{"generator": 1}))
	write(t, dir, "metrics.jsonl", m.String())
	write(t, dir, "rollouts.jsonl", r.String())
	write(t, dir, "events.log", "2026-11-28T04:43:06Z loaded debate.star\n2026-11-28T04:43:08Z rollout 1 of step 3 failed: boom\n")
	write(t, dir, "config.yaml", "policies:\n  - name: generator\n")
	write(t, dir, "script.star", "def rollout(task):\n    pass\n")
	return dir
}

func write(t testing.TB, dir, name, s string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func appendTo(t testing.TB, dir, name, s string) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

func newServer(t *testing.T, dir string, opts Options) *Server {
	t.Helper()
	if opts.Logf == nil {
		opts.Logf = t.Logf
	}
	s, err := New(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// get sends a request to h as a browser on this machine would, and returns the status and body.
func get(t testing.TB, h http.Handler, target string, hdr ...string) (int, string) {
	t.Helper()
	req := httptest.NewRequest("GET", target, nil)
	req.Host = "127.0.0.1:7000"
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code, rec.Body.String()
}

func getJSON[T any](t testing.TB, h http.Handler, target string) T {
	t.Helper()
	code, body := get(t, h, target)
	if code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", target, code, body)
	}
	var v T
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("GET %s: %v\n%s", target, err, body)
	}
	return v
}

func TestNewRefusesWhatIsNotARunFolder(t *testing.T) {
	tmp := t.TempDir()
	file := filepath.Join(tmp, "notes.txt")
	write(t, tmp, "notes.txt", "x")
	for _, tc := range []struct{ dir, want string }{
		{filepath.Join(tmp, "missing"), filepath.Join(tmp, "missing") + ": no such run folder"},
		{file, file + " is a file, not a run folder"},
		{tmp, tmp + " is not a run folder: it has none of events.log, metrics.jsonl, config.yaml"},
	} {
		_, err := New(tc.dir, Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%s) = %v, want an error containing %q", tc.dir, err, tc.want)
		}
	}
	// A run that has only started (events.log, nothing else yet) is one.
	write(t, tmp, "events.log", "")
	if _, err := New(tmp, Options{}); err != nil {
		t.Errorf("a folder with events.log: %v", err)
	}
}

func TestPageAndAssetsNeedNothingFromOutside(t *testing.T) {
	s := newServer(t, fixtureRun(t), Options{})
	for _, p := range []string{"/", "/static/app.js", "/static/app.css"} {
		code, body := get(t, s, p)
		if code != 200 || len(body) < 500 {
			t.Fatalf("GET %s: %d, %d bytes", p, code, len(body))
		}
		// Everything the page needs is in the binary: no address outside the server, but SVG's
		// namespace name (an identifier, never fetched).
		for _, u := range regexp.MustCompile(`(?:https?:)?//[a-zA-Z0-9.-]+\.[a-z]{2,}[^"' )]*`).FindAllString(body, -1) {
			if u != "http://www.w3.org/2000/svg" {
				t.Errorf("%s refers to %s", p, u)
			}
		}
	}
	if code, _ := get(t, s, "/static/nothing.js"); code != 404 {
		t.Errorf("an asset that is not there: %d, want 404", code)
	}
}

type curves struct {
	Gen    int   `json:"gen"`
	Offset int64 `json:"offset"`
	Size   int64 `json:"size"`
	More   bool  `json:"more"`
	Reset  bool  `json:"reset"`
	Series []struct {
		Source, Dataset, Key string
		Points               [][2]float64
	} `json:"series"`
	Lines []struct {
		Source, Dataset string
		Steps           []int
	} `json:"lines"`
	Skipped int `json:"skipped"`
}

func (c curves) points(source, key string) [][2]float64 {
	for _, s := range c.Series {
		if s.Source == source && s.Key == key {
			return s.Points
		}
	}
	return nil
}

func TestCurvesFollowTheFileAsItGrows(t *testing.T) {
	dir := fixtureRun(t)
	s := newServer(t, dir, Options{})
	c := getJSON[curves](t, s, "/api/curves?from=0")
	if got := c.points("generator", "reward_mean"); len(got) != 4 || got[3] != [2]float64{4, 0.8} {
		t.Errorf("generator reward_mean = %v, want 4 steps ending at (4, 0.8)", got)
	}
	if got := c.points("_eval", "accuracy"); len(got) != 1 || got[0] != [2]float64{0, 0.25} {
		t.Errorf("eval accuracy = %v", got)
	}
	if c.Offset != c.Size || c.More || c.Reset {
		t.Errorf("offset %d of %d, more %v, reset %v: want the whole file", c.Offset, c.Size, c.More, c.Reset)
	}
	// A line being written is not read until its newline is there.
	appendTo(t, dir, "metrics.jsonl", `{"step":5,"policy":"generator","reward_mean":0.9`)
	d := getJSON[curves](t, s, fmt.Sprintf("/api/curves?from=%d&gen=%d", c.Offset, c.Gen))
	if d.Offset != c.Offset || len(d.Series) != 0 || d.Skipped != 0 {
		t.Errorf("with a half-written line: offset %d (want %d), series %v, skipped %d", d.Offset, c.Offset, d.Series, d.Skipped)
	}
	appendTo(t, dir, "metrics.jsonl", `,"loss":0.3}`+"\n"+`{"step":5,"policy":"_run"}`+"\n")
	d = getJSON[curves](t, s, fmt.Sprintf("/api/curves?from=%d&gen=%d", d.Offset, d.Gen))
	if got := d.points("generator", "reward_mean"); len(got) != 1 || got[0] != [2]float64{5, 0.9} {
		t.Errorf("after the line is finished: %v, want only step 5's 0.9", got)
	}
	if d.Reset || d.Gen != c.Gen {
		t.Errorf("an appended file reset the page (gen %d → %d)", c.Gen, d.Gen)
	}
	if !slices.ContainsFunc(d.Lines, func(l struct {
		Source, Dataset string
		Steps           []int
	}) bool {
		return l.Source == "_run" && slices.Equal(l.Steps, []int{5})
	}) {
		t.Errorf("lines %v: want _run at step 5", d.Lines)
	}
	// A resumed run replaces metrics.jsonl by a rename, without the steps after its checkpoint:
	// the page starts again from the beginning.
	write(t, dir, "metrics.new", `{"step":1,"policy":"generator","reward_mean":0.7}`+"\n")
	if err := os.Rename(filepath.Join(dir, "metrics.new"), filepath.Join(dir, "metrics.jsonl")); err != nil {
		t.Fatal(err)
	}
	e := getJSON[curves](t, s, fmt.Sprintf("/api/curves?from=%d&gen=%d", d.Offset, d.Gen))
	if !e.Reset || e.Gen == d.Gen || len(e.points("generator", "reward_mean")) != 1 {
		t.Errorf("after the file was replaced: reset %v gen %d→%d series %v", e.Reset, d.Gen, e.Gen, e.Series)
	}
	if code, body := get(t, s, "/api/curves?from=x"); code != 400 || !strings.Contains(body, `from="x" is not a byte offset`) {
		t.Errorf("from=x: %d %s", code, body)
	}
}

func TestCurvesComeInChunks(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	for s := 1; b.Len() < curvesChunk+(1<<20); s++ {
		fmt.Fprintf(&b, `{"step":%d,"policy":"solver","reward_mean":%d,"pad":"%s"}`+"\n", s, s, strings.Repeat("x", 200))
	}
	write(t, dir, "metrics.jsonl", b.String())
	s := newServer(t, dir, Options{})
	var from int64
	var gen, steps, calls int
	for more := true; more; calls++ {
		c := getJSON[curves](t, s, fmt.Sprintf("/api/curves?from=%d&gen=%d", from, gen))
		steps += len(c.points("solver", "reward_mean"))
		from, gen, more = c.Offset, c.Gen, c.More
	}
	if n := strings.Count(b.String(), "\n"); steps != n || calls < 2 {
		t.Errorf("%d points in %d answers, want %d in at least 2", steps, calls, n)
	}
}

type eventsAnswer struct {
	Gen    int      `json:"gen"`
	Offset int64    `json:"offset"`
	Cut    bool     `json:"cut"`
	More   bool     `json:"more"`
	Lines  []string `json:"lines"`
}

func TestEventsTail(t *testing.T) {
	dir := fixtureRun(t)
	s := newServer(t, dir, Options{})
	e := getJSON[eventsAnswer](t, s, "/api/events?from=-1")
	if len(e.Lines) != 2 || !strings.Contains(e.Lines[1], "failed: boom") || e.Cut {
		t.Fatalf("events: %+v", e)
	}
	appendTo(t, dir, "events.log", "2026-11-28T04:43:09Z done: 4 steps\n2026-11-28T04:43:10Z half")
	f := getJSON[eventsAnswer](t, s, fmt.Sprintf("/api/events?from=%d&gen=%d", e.Offset, e.Gen))
	if !slices.Equal(f.Lines, []string{"2026-11-28T04:43:09Z done: 4 steps"}) {
		t.Errorf("new lines %q, want the finished one only", f.Lines)
	}
	// A long log is first shown from its end, starting at a whole line.
	var b strings.Builder
	for i := 0; b.Len() < 2*eventsChunk; i++ {
		fmt.Fprintf(&b, "line %06d %s\n", i, strings.Repeat("y", 100))
	}
	write(t, dir, "events.log", b.String())
	g := getJSON[eventsAnswer](t, s, "/api/events?from=-1")
	if !g.Cut || g.More || !strings.HasPrefix(g.Lines[0], "line ") || !strings.HasSuffix(g.Lines[len(g.Lines)-1], "y") {
		t.Errorf("tail of a long log: cut %v more %v, first %.20q last %.20q", g.Cut, g.More, g.Lines[0], g.Lines[len(g.Lines)-1])
	}
}

type rolloutsAnswer struct {
	Exists   bool             `json:"exists"`
	Total    int              `json:"total"`
	Indexed  int              `json:"indexed"`
	Bad      int              `json:"bad"`
	Policies []string         `json:"policies"`
	MinStep  int              `json:"min_step"`
	MaxStep  int              `json:"max_step"`
	Items    []map[string]any `json:"items"`
}

func (r rolloutsAnswer) ids() []string {
	var out []string
	for _, it := range r.Items {
		out = append(out, fmt.Sprintf("%v/%v", it["step"], it["index"]))
	}
	return out
}

func TestRolloutsPagesAndFilters(t *testing.T) {
	s := newServer(t, fixtureRun(t), Options{})
	for _, tc := range []struct {
		query string
		total int
		want  []string
	}{
		{"per_page=4", 13, []string{"4/0", "4/1", "4/2", "4/0"}}, // the newest step first, its lines in file order (the eval last)
		{"per_page=4&page=3", 13, []string{"1/2"}},
		{"order=asc&per_page=2", 13, []string{"1/0", "1/1"}},
		{"step=2", 3, []string{"2/0", "2/1", "2/2"}},
		{"min_step=2&max_step=3&order=asc&per_page=2", 6, []string{"2/0", "2/1"}},
		{"status=failed", 1, []string{"3/1"}},
		{"kind=eval", 1, []string{"4/0"}},
		{"kind=train&status=ok&step=4", 3, []string{"4/0", "4/1", "4/2"}},
		{"policy=generator&min_reward=1&kind=train", 4, []string{"4/1", "3/1", "2/1", "1/1"}},
		{"policy=critic&min_reward=0.8", 3, []string{"4/0", "4/1", "4/2"}},
		{"policy=critic&max_reward=0.25", 3, []string{"1/0", "1/1", "1/2"}},
		{"min_reward=5", 0, nil},
		{"policy=nobody", 0, nil},
	} {
		r := getJSON[rolloutsAnswer](t, s, "/api/rollouts?"+tc.query)
		if r.Total != tc.total || !slices.Equal(r.ids(), tc.want) {
			t.Errorf("%s: %d matching, page %v; want %d, %v", tc.query, r.Total, r.ids(), tc.total, tc.want)
		}
		if r.Indexed != 13 || !slices.Equal(r.Policies, []string{"critic", "generator"}) || r.MinStep != 1 || r.MaxStep != 4 {
			t.Errorf("%s: indexed %d, policies %v, steps %d–%d", tc.query, r.Indexed, r.Policies, r.MinStep, r.MaxStep)
		}
	}
	// A page holds the records whole: the failed one with its backtrace, calls with their tokens.
	r := getJSON[rolloutsAnswer](t, s, "/api/rollouts?status=failed")
	if err, _ := r.Items[0]["error"].(string); !strings.Contains(err, "debate.star:12:5: in rollout") {
		t.Errorf("the failed rollout's error: %q", err)
	}
	calls, _ := r.Items[0]["calls"].([]any)
	if len(calls) != 2 || calls[0].(map[string]any)["pieces"] == nil {
		t.Errorf("calls of the record: %v", calls)
	}
	for q, want := range map[string]string{
		"per_page=0":                `per_page="0" is not a whole number of at least 1`,
		"min_reward=a":              `min_reward="a" is not a number`,
		"min_reward=2&max_reward=1": "min_reward 2 is above max_reward 1",
		"status=broken":             `status="broken": give failed, ok or nothing`,
		"kind=test":                 `kind="test": give train, eval or nothing`,
		"step=three":                `step="three" is not a step number`,
		"page=-1":                   `page="-1" is not a whole number of at least 0`,
		"max_step=x":                `max_step="x" is not a whole number`,
		"page=99999999999":          "page=99999999999 is past any run's rollouts",
	} {
		if code, body := get(t, s, "/api/rollouts?"+q); code != 400 || !strings.Contains(body, want) {
			t.Errorf("%s: %d %q, want 400 with %q", q, code, body, want)
		}
	}
}

func TestRolloutsIndexGrowsWithTheFile(t *testing.T) {
	dir := t.TempDir()
	write(t, dir, "events.log", "")
	s := newServer(t, dir, Options{})
	if r := getJSON[rolloutsAnswer](t, s, "/api/rollouts"); r.Exists || r.Total != 0 {
		t.Errorf("before the file exists: %+v", r)
	}
	write(t, dir, "rollouts.jsonl", rolloutLine(1, 0, false, false, map[string]float64{"solver": 1}))
	line := rolloutLine(2, 0, false, false, map[string]float64{"solver": 0})
	appendTo(t, dir, "rollouts.jsonl", line[:len(line)/2]) // a step being written
	if r := getJSON[rolloutsAnswer](t, s, "/api/rollouts"); !r.Exists || r.Total != 1 || r.Bad != 0 {
		t.Errorf("with a half-written line: %d rollouts, %d bad; want 1 and 0", r.Total, r.Bad)
	}
	appendTo(t, dir, "rollouts.jsonl", line[len(line)/2:]+"not json\n")
	r := getJSON[rolloutsAnswer](t, s, "/api/rollouts")
	if r.Total != 2 || r.Bad != 1 || !slices.Equal(r.ids(), []string{"2/0", "1/0"}) {
		t.Errorf("after the line is finished: %d rollouts %v, %d bad", r.Total, r.ids(), r.Bad)
	}
	if s.index.end != int64(len(rolloutLine(1, 0, false, false, map[string]float64{"solver": 1}))+len(line)+len("not json\n")) {
		t.Errorf("indexed up to %d", s.index.end)
	}
}

func TestTokenOffLoopback(t *testing.T) {
	if _, err := Listen("0.0.0.0:0", Options{}); err == nil || !strings.Contains(err.Error(), "listen address 0.0.0.0:0 is not loopback") || !strings.Contains(err.Error(), "--token-env") {
		t.Errorf("Listen off loopback without a token: %v", err)
	}
	l, err := Listen("127.0.0.1:0", Options{})
	if err != nil {
		t.Fatalf("loopback without a token: %v", err)
	}
	l.Close()
	l, err = Listen("0.0.0.0:0", Options{Token: "s3cret"})
	if err != nil {
		t.Fatalf("off loopback with a token: %v", err)
	}
	l.Close()

	s := newServer(t, fixtureRun(t), Options{Token: "s3cret"})
	for _, p := range []string{"/", "/static/app.js", "/api/run", "/api/rollouts", "/api/curves", "/api/events", "/api/text?file=config.yaml", "/api/graph"} {
		if code, body := get(t, s, p); code != 401 || !strings.Contains(body, "needs its token") {
			t.Errorf("GET %s without the token: %d %q", p, code, body)
		}
		if code, _ := get(t, s, p, "Authorization", "Bearer wrong"); code != 401 {
			t.Errorf("GET %s with a wrong token: %d", p, code)
		}
		if code, _ := get(t, s, p, "Authorization", "Bearer s3cret"); code != 200 {
			t.Errorf("GET %s with the token: %d", p, code)
		}
	}
	// A browser opens /?token=…: the answer keeps the token in a cookie and sends it to /.
	req := httptest.NewRequest("GET", "/?token=s3cret", nil)
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	cookies := rec.Result().Cookies()
	if rec.Code != http.StatusSeeOther || rec.Header().Get("Location") != "/" || len(cookies) != 1 || !cookies[0].HttpOnly {
		t.Fatalf("/?token=: %d, Location %q, cookies %v", rec.Code, rec.Header().Get("Location"), cookies)
	}
	req = httptest.NewRequest("GET", "/api/run", nil)
	req.AddCookie(cookies[0])
	rec = httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Errorf("with the cookie: %d", rec.Code)
	}
	// The same server off loopback answers any Host: the token is what it checks.
	req = httptest.NewRequest("GET", "/api/run", nil)
	req.Host = "example.com"
	req.Header.Set("Authorization", "Bearer s3cret")
	rec = httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	if rec.Code != 200 {
		t.Errorf("another Host with the token: %d", rec.Code)
	}
}

func TestLoopbackServerAnswersLoopbackNamesOnly(t *testing.T) {
	s := newServer(t, fixtureRun(t), Options{})
	for host, want := range map[string]int{"127.0.0.1:8000": 200, "localhost:8000": 200, "[::1]:8000": 200, "evil.example:8000": 403, "10.0.0.2:8000": 403} {
		req := httptest.NewRequest("GET", "/api/run", nil)
		req.Host = host
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		if rec.Code != want {
			t.Errorf("Host %s: %d, want %d", host, rec.Code, want)
		}
	}
}

func TestOnlyTheRunFolderIsRead(t *testing.T) {
	outside := t.TempDir()
	write(t, outside, "secret.txt", "the secret")
	dir := fixtureRun(t)
	// config.yaml a link out of the run folder: os.Root refuses to follow it.
	os.Remove(filepath.Join(dir, "config.yaml"))
	if err := os.Symlink(filepath.Join(outside, "secret.txt"), filepath.Join(dir, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	s := newServer(t, dir, Options{})
	rel, err := filepath.Rel(dir, filepath.Join(outside, "secret.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{
		"/api/text?file=" + url.QueryEscape(rel),
		"/api/text?file=" + url.QueryEscape(filepath.Join(outside, "secret.txt")),
		"/api/text?file=config.yaml",
		"/api/text?file=metrics.jsonl",
		"/api/text?file=..%2Fsecret.txt",
		"/static/..%2F..%2Fsecret.txt",
		"/static/%2e%2e/%2e%2e/secret.txt",
		"/../../secret.txt",
		"/" + rel,
	} {
		code, body := get(t, s, p)
		if code == 200 || strings.Contains(body, "the secret") {
			t.Errorf("GET %s: %d %q", p, code, body)
		}
	}
	if code, body := get(t, s, "/api/text?file=script.star"); code != 200 || !strings.Contains(body, "def rollout") {
		t.Errorf("script.star: %d %q", code, body)
	}
	if code, body := get(t, s, "/api/text?file=../x"); code != 403 || !strings.Contains(body, `"../x" is not a file this page shows`) {
		t.Errorf("../x: %d %q", code, body)
	}
}

func TestGraphIsDrawnOnce(t *testing.T) {
	calls := 0
	s := newServer(t, fixtureRun(t), Options{Graph: func(context.Context) (Drawing, error) {
		calls++
		return Drawing{SVG: []byte("<svg><text>generator</text></svg>"), Mermaid: "flowchart LR", Policies: []string{"generator", "critic"}}, nil
	}})
	for range 2 {
		g := getJSON[graphReply](t, s, "/api/graph")
		if g.SVG != "<svg><text>generator</text></svg>" || g.Mermaid != "flowchart LR" || !slices.Equal(g.Policies, []string{"generator", "critic"}) || g.Error != "" {
			t.Errorf("graph: %+v", g)
		}
	}
	if calls != 1 {
		t.Errorf("the graph was drawn %d times, want once", calls)
	}
	s = newServer(t, fixtureRun(t), Options{Graph: func(context.Context) (Drawing, error) {
		return Drawing{}, errors.New("the traced rollout failed")
	}})
	if g := getJSON[graphReply](t, s, "/api/graph"); g.Error != "the traced rollout failed" {
		t.Errorf("a graph that cannot be drawn: %+v", g)
	}
}

func TestRunInfo(t *testing.T) {
	dir := fixtureRun(t)
	s := newServer(t, dir, Options{})
	var r struct {
		Name  string
		Files map[string]bool
	}
	code, body := get(t, s, "/api/run")
	if code != 200 {
		t.Fatal(code, body)
	}
	if err := json.NewDecoder(io.NopCloser(strings.NewReader(body))).Decode(&r); err != nil {
		t.Fatal(err)
	}
	if r.Name != filepath.Base(dir) || !r.Files["rollouts.jsonl"] || !r.Files["metrics.jsonl"] {
		t.Errorf("run: %+v", r)
	}
}

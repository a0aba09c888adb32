package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/graph"
	"github.com/slimen/slimen/host/tasks"
	"github.com/slimen/slimen/host/view"
)

func init() {
	commands["view"] = command{"a live local web page of a run: curves, topology, rollouts with their tokens", cmdView}
}

func cmdView(args []string) int {
	fs := flag.NewFlagSet("view", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:0", "host:port to serve the page on (port 0: a free one, printed); anything but loopback needs --token-env")
	tokenEnv := fs.String("token-env", "", "environment variable holding the token the page asks for (open it as http://HOST:PORT/?token=TOKEN)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen view RUN_DIR [--listen ADDR] [--token-env VAR]\n\n"+
			"Serves a web page of the run in RUN_DIR (the --out folder of slimen exec): its curves, the\n"+
			"dataflow between its policies, its saved rollouts with every token's loss mask and\n"+
			"advantage, events.log and the config. The page follows a running run live; a finished run\n"+
			"shows the same. It prints the address to open and serves until interrupted.")
		fs.PrintDefaults()
	}
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(pos) != 1 {
		fs.Usage()
		return 2
	}
	dir := pos[0]
	bad := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "slimen view: "+format+"\n", a...)
		return 2
	}
	opts := view.Options{Logf: log.Printf, Graph: func(ctx context.Context) (view.Drawing, error) { return runGraph(ctx, dir) }}
	if *tokenEnv != "" {
		if opts.Token = os.Getenv(*tokenEnv); opts.Token == "" {
			return bad("--token-env %s: the environment variable is empty or unset; export the token in it", *tokenEnv)
		}
	}
	srv, err := view.New(dir, opts)
	if err != nil {
		return bad("%v", err)
	}
	defer srv.Close()
	l, err := view.Listen(*listen, opts)
	if err != nil {
		return bad("--listen: %v", err)
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	url := "http://" + l.Addr().String() + "/"
	if opts.Token != "" {
		log.Printf("serving the page of %s at %s?token=… (the token from $%s)", dir, url, *tokenEnv)
	} else {
		log.Printf("serving the page of %s on loopback only, no token", dir)
	}
	fmt.Println(url) // the address to open, on stdout: a script may read it
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(l) }()
	select {
	case err := <-errc:
		fmt.Fprintf(os.Stderr, "slimen view: %v\n", err)
		return 1
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hs.Shutdown(sctx)
	return 0
}

// runGraph draws the dataflow of a run folder's script as `slimen graph` does: it traces one
// rollout of the newest script version the run kept (scripts/step_N-HASH/, with the files it
// loads, else script.star) on scripted policies, with the run's config.yaml and a task it saved in
// rollouts.jsonl (else one of its data source, when that is synthetic).
func runGraph(ctx context.Context, dir string) (view.Drawing, error) {
	script, err := runScript(dir)
	if err != nil {
		return view.Drawing{}, err
	}
	var cfg *config.Config
	if _, err := os.Stat(filepath.Join(dir, "config.yaml")); err == nil {
		if cfg, err = config.Load(filepath.Join(dir, "config.yaml")); err != nil {
			return view.Drawing{}, err
		}
		// The trace evaluates nothing: eval files, named relative to where the run started,
		// need not be found from here.
		cfg.Eval.Datasets = nil
	}
	task, err := runTask(dir, cfg)
	if err != nil {
		return view.Drawing{}, err
	}
	g, err := traceGraph(ctx, script, cfg, task)
	if err != nil {
		return view.Drawing{}, err
	}
	g.Title = "dataflow of one rollout of " + filepath.Base(script)
	return view.Drawing{SVG: graph.SVG(g), Mermaid: graph.Mermaid(g), Policies: g.Policies()}, nil
}

// runScript finds the script a run folder keeps: the main script in the newest version folder
// (scripts/step_N-HASH/, whose files are at their paths relative to it, so its relative loads
// resolve), recognised as the file equal to script.star; else script.star itself.
func runScript(dir string) (string, error) {
	main := filepath.Join(dir, "script.star")
	src, err := os.ReadFile(main)
	if err != nil {
		return "", fmt.Errorf("%s: the run folder keeps no script to trace", main)
	}
	versions, _ := filepath.Glob(filepath.Join(dir, "scripts", "step_*-*"))
	stepOf := func(p string) int {
		s, _, _ := strings.Cut(strings.TrimPrefix(filepath.Base(p), "step_"), "-")
		n, _ := strconv.Atoi(s)
		return n
	}
	slices.SortFunc(versions, func(a, b string) int { return stepOf(b) - stepOf(a) })
	if len(versions) > 0 {
		stars, _ := filepath.Glob(filepath.Join(versions[0], "*.star"))
		for _, p := range stars {
			if b, err := os.ReadFile(p); err == nil && bytes.Equal(b, src) {
				return p, nil
			}
		}
	}
	return main, nil
}

// runTask is the task to trace: the first one the run saved in rollouts.jsonl, else the first of
// the config's data source when it is synthetic (a file path is the run's working directory's,
// which the view does not read).
func runTask(dir string, cfg *config.Config) (tasks.Task, error) {
	if f, err := os.Open(filepath.Join(dir, "rollouts.jsonl")); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		sc.Buffer(nil, 64<<20)
		for sc.Scan() {
			var rec struct {
				Eval bool `json:"eval"`
				Task *struct {
					ID       string            `json:"id"`
					Prompt   string            `json:"prompt"`
					Messages []engines.Message `json:"messages"`
					Label    *string           `json:"label"`
				} `json:"task"`
			}
			if json.Unmarshal(sc.Bytes(), &rec) != nil || rec.Task == nil || rec.Eval {
				continue
			}
			t := tasks.Task{ID: rec.Task.ID, Prompt: rec.Task.Prompt}
			if len(rec.Task.Messages) > 0 {
				t.Prompt = rec.Task.Messages
			}
			if rec.Task.Label != nil {
				t.Label, t.HasLabel = *rec.Task.Label, true
			}
			return t, nil
		}
	}
	dc := config.Default(nil)
	if cfg != nil {
		dc = cfg
	}
	if !strings.HasPrefix(dc.Data.Path, "synthetic:") {
		return tasks.Task{}, errors.New("no task to trace: the run has saved no rollout yet (rollouts.jsonl), and its data is a file of the folder it ran in")
	}
	src, err := tasks.Open(dc.Data.Path, tasks.Options{InputKey: dc.Data.InputKey, LabelKey: dc.Data.LabelKey, Seed: dc.Run.Seed})
	if err != nil {
		return tasks.Task{}, err
	}
	return src.Task(0), nil
}

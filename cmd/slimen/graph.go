package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/graph"
	"github.com/slimen/slimen/host/tasks"
)

func init() {
	commands["graph"] = command{"trace one rollout and draw the dataflow between policies (Mermaid and SVG)", cmdGraph}
}

func cmdGraph(args []string) int {
	fs := flag.NewFlagSet("graph", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "YAML config (its policies and data source)")
	out := fs.String("out", "", "folder for NAME.mmd and NAME.svg (default: runs/NAME, NAME being the script's name without .star)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen graph SCRIPT [--config Y] [--out DIR]\n\n"+
			"Traces one rollout of SCRIPT on scripted policies and draws the dataflow between them as\n"+
			"NAME.mmd (Mermaid) and NAME.svg in runs/NAME/ under the current folder, or in --out DIR,\n"+
			"then prints the two paths.")
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
	script := pos[0]
	var cfg *config.Config
	if *cfgPath != "" {
		if cfg, err = config.Load(*cfgPath); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	dc := config.Default(nil)
	if cfg != nil {
		dc = cfg
	}
	src, err := tasks.Open(dc.Data.Path, tasks.Options{InputKey: dc.Data.InputKey, LabelKey: dc.Data.LabelKey, Seed: dc.Run.Seed})
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen graph:", err)
		return 2
	}
	g, err := traceGraph(context.Background(), script, cfg, src.Task(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen graph:", err)
		return 1
	}
	// By default the drawings go where runs go (runs/ is the place for outputs, and is ignored by
	// git), never beside the script.
	name := strings.TrimSuffix(filepath.Base(script), filepath.Ext(script))
	dir := *out
	if dir == "" {
		dir = filepath.Join("runs", name)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "slimen graph:", err)
		return 1
	}
	mmd, svg := filepath.Join(dir, name+".mmd"), filepath.Join(dir, name+".svg")
	if err := os.WriteFile(mmd, []byte(graph.Mermaid(g)), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "slimen graph:", err)
		return 1
	}
	if err := os.WriteFile(svg, graph.SVG(g), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "slimen graph:", err)
		return 1
	}
	fmt.Printf("%s\n%s\n", mmd, svg)
	return 0
}

// traceGraph traces one rollout of script and draws the dataflow between its policies.
func traceGraph(ctx context.Context, script string, cfg *config.Config, task tasks.Task) (graph.Graph, error) {
	traced, err := host.Trace(ctx, script, cfg, task)
	if err != nil {
		return graph.Graph{}, err
	}
	calls := make([]graph.Call, len(traced))
	for i, c := range traced {
		calls[i] = graph.Call{Policy: c.Policy, Prompt: c.Prompt, Outputs: c.Outputs}
	}
	return graph.Dataflow(script+": dataflow of one rollout", calls), nil
}

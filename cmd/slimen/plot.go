package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/slimen/slimen/host/plot"
)

func init() {
	commands["plot"] = command{"redraw a run's reward, accuracy and loss curves into RUN_DIR/plots", cmdPlot}
}

func cmdPlot(args []string) int {
	fs := flag.NewFlagSet("plot", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen plot RUN_DIR...\n\nReads RUN_DIR/metrics.jsonl and writes reward, "+
			"accuracy and loss charts (SVG and PNG) into RUN_DIR/plots, then prints the files written.")
		fs.PrintDefaults()
	}
	dirs, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(dirs) == 0 {
		fs.Usage()
		return 2
	}
	code := 0
	for _, dir := range dirs {
		metrics := filepath.Join(dir, "metrics.jsonl")
		r, err := plot.Load(metrics)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slimen plot: %v (is %s a run directory?)\n", err, dir)
			code = max(code, 2)
			continue
		}
		if n := len(r.Skipped); n > 0 {
			fmt.Fprintf(os.Stderr, "slimen plot: %s: left out %d malformed line(s), the first is line %d\n", metrics, n, r.Skipped[0])
		}
		files, err := r.Write(filepath.Join(dir, "plots"))
		for _, f := range files {
			fmt.Println(f)
		}
		switch {
		case errors.Is(err, plot.ErrNothingToPlot):
			fmt.Fprintf(os.Stderr, "slimen plot: %s: %v\n", metrics, err)
			code = max(code, 2)
		case err != nil:
			fmt.Fprintf(os.Stderr, "slimen plot: %s: %v\n", dir, err)
			code = max(code, 1)
		}
	}
	return code
}

package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

func init() {
	commands["check"] = command{"check a script without running it (syntax, names, policies)", cmdCheck}
}

func cmdCheck(args []string) int {
	fs := flag.NewFlagSet("check", flag.ContinueOnError)
	cfgPath := fs.String("config", "", "YAML config whose policies the script's generate/train calls must name")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen check SCRIPT [--config Y]")
		fs.PrintDefaults()
	}
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	if len(pos) == 0 {
		fs.Usage()
		return 2
	}
	var cfg *config.Config
	if *cfgPath != "" {
		if cfg, err = config.Load(*cfgPath); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		for _, w := range cfg.Warnings { // what a run would say at start-up
			fmt.Fprintln(os.Stderr, "warning: "+w)
		}
	}
	bad := false
	for _, path := range pos {
		problems, warnings := script.Lint(path, cfg)
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, p)
		}
		for _, w := range warnings {
			fmt.Fprintln(os.Stderr, "warning: "+w)
		}
		if len(problems) > 0 {
			bad = true
			continue
		}
		fmt.Fprintf(os.Stderr, "%s: ok\n", path)
	}
	if bad {
		return 2
	}
	return 0
}

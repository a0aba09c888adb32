package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"github.com/slimen/slimen/host/scripttest"
)

func init() {
	commands["test"] = command{"run the test_* functions of *_test.star files on scripted policies", cmdTest}
}

func cmdTest(args []string) int {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen test [FILES or FOLDERS]   (default: every *_test.star below .)")
	}
	pos, err := parseInterleaved(fs, args)
	if err != nil {
		return flagExit(err)
	}
	files, err := scripttest.FindFiles(pos)
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen test:", err)
		return 2
	}
	if len(files) == 0 {
		fmt.Fprintln(os.Stderr, "slimen test: no *_test.star files found")
		return 2
	}
	results := scripttest.Run(context.Background(), files, os.Stdout)
	failed, skipped := 0, 0
	for _, r := range results {
		switch {
		case r.Err != "":
			failed++
		case r.Skipped != "":
			skipped++
		}
	}
	line := fmt.Sprintf("%d passed, %d failed", len(results)-failed-skipped, failed)
	if skipped > 0 {
		line += fmt.Sprintf(", %d skipped", skipped)
	}
	fmt.Println(line)
	if failed > 0 {
		return 1
	}
	return 0
}

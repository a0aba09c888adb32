// Command slimen runs multi-agent reinforcement-learning rollouts written in Starlark.
//
//	slimen exec SCRIPT [--config Y] …   train every policy the script names
//	slimen help                          list the commands
//
// The CLI is thin: each subcommand parses its flags and calls into host/ or engines/.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"slices"
	"sort"

	"github.com/slimen/slimen/host/jail"
	"github.com/slimen/slimen/host/script/sandbox"
	_ "github.com/slimen/slimen/host/torch" // engine kind torch: the PyTorch worker
)

// command is one subcommand. run returns the process exit code: 0 ok, 1 run failed, 2 bad input.
type command struct {
	summary string
	run     func(args []string) int
}

// commands is filled by the init functions of the files beside this one, one file a subcommand.
var commands = map[string]command{}

func main() {
	if os.Getenv(jail.InitEnv) != "" {
		// This process is the first of a jail that a sandbox child made for an agent() program.
		os.Exit(jail.Init())
	}
	if os.Getenv(sandbox.ChildEnv) != "" {
		// This process evaluates a sandboxed script's rollouts for a parent slimen (host/script/sandbox).
		os.Exit(sandbox.ChildMain())
	}
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(2)
	}
	switch os.Args[1] {
	case "help", "-h", "-help", "--help":
		usage(os.Stdout) // asked for: the answer, on stdout
		return
	case "version", "-version", "--version":
		fmt.Println(version())
		return
	}
	c, ok := commands[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "slimen: unknown command %q\n\n", os.Args[1])
		usage(os.Stderr)
		os.Exit(2)
	}
	if slices.ContainsFunc(os.Args[2:], func(a string) bool { return a == "-h" || a == "-help" || a == "--help" }) {
		// A command's usage, asked for, goes to stdout (slimen exec --help | less): the flag
		// package writes it to os.Stderr, which for this one invocation is stdout.
		os.Stderr = os.Stdout
	}
	os.Exit(c.run(os.Args[2:]))
}

// version is the binary's module version, Go version and VCS revision, as the build recorded them.
func version() string {
	v := "slimen (devel)"
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	if bi.Main.Version != "" {
		v = "slimen " + bi.Main.Version
	}
	v += ", " + bi.GoVersion
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v += ", commit " + s.Value
		case "vcs.modified":
			if s.Value == "true" {
				v += " (modified)"
			}
		}
	}
	return v
}

// flagExit is a command's exit code for an error from parsing its flags: 0 when the user asked
// for -h/--help, 2 for a bad flag. Either way the flag package has printed the usage once.
func flagExit(err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	return 2
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: slimen COMMAND [ARGS]   (slimen --version: the build)\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-10s %s\n", n, commands[n].summary)
	}
}

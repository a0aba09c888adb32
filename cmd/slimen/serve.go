package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"maps"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
)

func init() {
	commands["serve"] = command{"serve a policy engine over gRPC for hosts elsewhere", cmdServe}
}

// serveEngines opens the Go engines `slimen serve` can expose, by --engine name.
var serveEngines = map[string]func(model string, threads int) (engines.Engine, error){
	"tiny": func(model string, threads int) (engines.Engine, error) {
		return tiny.Open(model, tiny.Options{Threads: threads})
	},
}

func cmdServe(args []string) int {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	kind := fs.String("engine", "tiny", "engine to serve: "+strings.Join(slices.Sorted(maps.Keys(serveEngines)), ", "))
	model := fs.String("model", "builtin:tiny-arith", "model to load: a Hugging Face folder or builtin:NAME")
	listen := fs.String("listen", "127.0.0.1:7777", "host:port to listen on; anything but loopback needs TLS or --insecure, and --token-env or --tls-client-ca")
	var roots rootFlag
	fs.Var(&roots, "root", "folder that clients' Save and Load may use (repeatable; relative paths are taken from the first; default: the current directory)")
	certFile := fs.String("tls-cert", "", "PEM certificate to serve TLS with (with --tls-key)")
	keyFile := fs.String("tls-key", "", "PEM private key of --tls-cert")
	clientCA := fs.String("tls-client-ca", "", "PEM CAs that sign client certificates: require mutual TLS")
	insecure := fs.Bool("insecure", false, "allow plaintext on a non-loopback address (a private network, or a TLS proxy in front)")
	tokenEnv := fs.String("token-env", "", "environment variable holding the bearer token clients must send")
	maxMB := fs.Int("max-message-mb", server.DefaultMaxMessageBytes>>20, "largest message accepted or sent, in MiB")
	threads := fs.Int("threads", 0, "tiny: goroutines for the math (0: all cores)")
	window := fs.Duration("batch-window", 0, "how long a generate request waits for others to batch with (0: start at once)")
	cfgPath := fs.String("config", "", "serve the engine of a policy of this run config instead of --engine/--model: any kind a run opens (tiny, torch, remote, openai); with --policy")
	policyName := fs.String("policy", "", "with --config: the policy whose engine to serve (default: the config's only policy)")
	openaiAddr := fs.String("openai", "", "also serve an OpenAI-compatible HTTP API (/v1/chat/completions, …) on host:port, with the same TLS, token and loopback rule")
	var limits openaiLimits
	fs.Int64Var(&limits.requestTokens, "openai-max-request-tokens", 0, "--openai: the most tokens one request may ask for, its prompts' and n × max_tokens for each (0: 1Mi, or 128 × the context length if more)")
	fs.Int64Var(&limits.requestSamples, "openai-max-request-samples", 0, "--openai: the most samples (prompts × n) one request may ask for (0: 4096)")
	fs.Int64Var(&limits.inFlight, "openai-max-tokens-in-flight", 0, "--openai: the most tokens, counted so, of the requests answered at once; past it, or past 4 × --openai-max-request-samples samples, a request gets 429 (0: 4 × --openai-max-request-tokens)")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen serve [--engine tiny] [--model M | --config C [--policy P]] [--listen ADDR] [--root DIR] [--tls-cert C --tls-key K [--tls-client-ca CA]] [--insecure] [--token-env VAR] [--openai ADDR]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return flagExit(err)
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	bad := func(format string, a ...any) int {
		fmt.Fprintf(os.Stderr, "slimen serve: "+format+"\n", a...)
		return 2
	}
	open, ok := serveEngines[*kind]
	if !ok {
		return bad("unknown engine %q; this binary serves: %s", *kind, strings.Join(slices.Sorted(maps.Keys(serveEngines)), ", "))
	}
	if *cfgPath != "" {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if set["engine"] || set["model"] || set["threads"] {
			return bad("--config names the engine (its policy's engine: section); leave out --engine, --model and --threads")
		}
		cfg, err := config.Load(*cfgPath)
		if err != nil {
			return bad("%v", err)
		}
		name := *policyName
		if name == "" {
			if len(cfg.Policies) != 1 {
				return bad("--config %s defines %d policies; name the one to serve with --policy (%s)", *cfgPath, len(cfg.Policies), config.QuotePolicyNames(cfg.PolicyNames()))
			}
			name = cfg.Policies[0].Name
		}
		*kind, *model = "policy", name
		open = func(string, int) (engines.Engine, error) {
			return host.OpenPolicyEngine(context.Background(), cfg, name, log.Printf)
		}
	} else if *policyName != "" {
		return bad("--policy names a policy of --config; give --config too")
	}
	if *maxMB < 1 {
		return bad("--max-message-mb must be at least 1")
	}
	rootDirs, err := server.ResolveRoots(roots)
	if err != nil {
		return bad("%v", err)
	}
	for _, d := range rootDirs {
		if _, err := os.Stat(d); err != nil {
			return bad("--root: %v; create the folder first", err)
		}
	}
	opts := server.Options{
		Roots:           rootDirs,
		Insecure:        *insecure,
		MaxMessageBytes: *maxMB << 20,
		BatchWindow:     *window,
		Logf:            log.Printf,
		Drain:           make(chan struct{}),
	}
	if *tokenEnv != "" {
		if opts.Token = os.Getenv(*tokenEnv); opts.Token == "" {
			return bad("--token-env %s: the environment variable is empty or unset; export the token in it", *tokenEnv)
		}
	}
	if *certFile != "" || *keyFile != "" || *clientCA != "" {
		cfg, err := server.TLSConfig(*certFile, *keyFile, *clientCA)
		if err != nil {
			return bad("%v", err)
		}
		opts.TLS = cfg
	}
	// Bind before loading the model: a wrong address should fail at once, not after a load.
	l, err := server.Listen(*listen, opts)
	if err != nil {
		return bad("%v", err)
	}
	var hl net.Listener
	if *openaiAddr != "" {
		if hl, err = listenOpenAI(*openaiAddr, opts); err != nil {
			l.Close()
			return bad("--openai: %v", err)
		}
		defer hl.Close()
	}
	if m := *model; *cfgPath == "" && !strings.HasPrefix(m, "builtin:") && !filepath.IsAbs(m) {
		// The engine reports its model by this name (Info), and a host that resets the engine
		// to it asks to Load that name, which the server takes from its root, not from here.
		if abs, err := filepath.Abs(m); err == nil {
			*model = abs
		}
	}
	eng, err := open(*model, *threads)
	if err != nil {
		l.Close()
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 2
	}
	defer eng.Close()
	srv := server.New(eng, opts)

	security := "plaintext"
	if opts.TLS != nil {
		security = "TLS"
		if opts.TLS.ClientCAs != nil {
			security = "mutual TLS"
		}
	}
	if opts.Token == "" {
		security += ", no token"
	} else {
		security += ", token from $" + *tokenEnv
	}
	log.Printf("serving %s engine %s on %s (%s, protocol version %d); clients save and load model folders only under %s", *kind, *model, l.Addr(), security, enginepb.ProtocolVersion, strings.Join(rootDirs, ", "))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(l) }()
	if hl != nil {
		var aliases []string
		if *kind == "policy" {
			aliases = []string{*model} // --config C --policy P: requests may name the policy
		}
		hs, err := serveOpenAI(eng, hl, opts, limits, errc, aliases...)
		if err != nil {
			fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
			return 1
		}
		defer func() { // requests under way finish, for up to 30 s, as on the gRPC side
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			hs.Shutdown(sctx)
		}()
		scheme := "http"
		if opts.TLS != nil {
			scheme = "https"
		}
		log.Printf("serving the OpenAI API at %s://%s/v1", scheme, hl.Addr())
	}
	select {
	case err := <-errc:
		fmt.Fprintf(os.Stderr, "slimen serve: %v\n", err)
		return 1
	case <-ctx.Done():
	}
	// Let calls under way finish (a train step, a batch being sampled), but not forever.
	log.Printf("stopping: waiting up to 30s for calls under way")
	close(opts.Drain)
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		srv.Stop()
	}
	return 0
}

// rootFlag collects the --root folders, in order.
type rootFlag []string

func (r *rootFlag) String() string { return strings.Join(*r, ", ") }

func (r *rootFlag) Set(s string) error {
	if s == "" {
		return errors.New("an empty folder name")
	}
	*r = append(*r, s)
	return nil
}

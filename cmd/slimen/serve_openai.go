package main

import (
	"context"
	"crypto/tls"
	"log"
	"net"
	"net/http"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/engines/server"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/starlib"
)

// listenOpenAI binds the address of `slimen serve --openai` under the rules of the gRPC address:
// loopback, or TLS, or --insecure.
func listenOpenAI(addr string, opts server.Options) (net.Listener, error) {
	l, err := server.Listen(addr, opts)
	if err != nil {
		return nil, err
	}
	if opts.TLS != nil {
		l = tls.NewListener(l, opts.TLS)
	}
	return l, nil
}

// openaiLimits are the --openai-max-* flags: a request's tokens and samples, and the tokens in
// flight (0: the front's defaults).
type openaiLimits struct {
	requestTokens, requestSamples, inFlight int64
}

// serveOpenAI serves eng's OpenAI-compatible front on l (with the server's token as its API
// key) until the returned server is shut down; Serve's error goes to errc. Requests may name the
// engine's model or one of aliases (a served policy's name). Tools for a model whose chat
// template has no tools variable are described in the system message, as agent()'s
// tools_prompt="system" does.
func serveOpenAI(eng engines.Engine, l net.Listener, opts server.Options, limits openaiLimits, errc chan<- error, aliases ...string) (*http.Server, error) {
	ho := openai.HandlerOptions{Token: opts.Token, Logf: log.Printf, Aliases: aliases, ToolsPrompt: starlib.ToolsSystemPrompt,
		MaxRequestTokens: limits.requestTokens, MaxRequestSamples: limits.requestSamples, MaxTokensInFlight: limits.inFlight}
	if t, ok := eng.(*tiny.Engine); ok {
		tok := t.Tokenizer()
		ho.Decode = func(id int32) string { return tok.Decode([]int32{id}) }
	}
	h, err := openai.NewHandler(context.Background(), eng, ho)
	if err != nil {
		return nil, err
	}
	s := openai.NewServer(h)
	go func() {
		if err := s.Serve(l); err != http.ErrServerClosed {
			errc <- err
		}
	}()
	return s, nil
}

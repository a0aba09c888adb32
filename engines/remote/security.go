package remote

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// transportCredentials applies the protocol's rule: plaintext only to a loopback address, unless
// the caller says so explicitly.
func transportCredentials(opts Options) (credentials.TransportCredentials, error) {
	addr := opts.Address
	if opts.TLS == nil {
		if !opts.Insecure && !enginepb.IsLoopback(addr) {
			return nil, fmt.Errorf("engine at %s: refusing plaintext to a non-loopback address, which would expose prompts, "+
				"weights and the token on the network: "+
				"give TLS settings (engine.tls: {ca: …}) or set engine.insecure: true if the network is private", addr)
		}
		return insecure.NewCredentials(), nil
	}
	cfg := &tls.Config{ServerName: opts.TLS.ServerName, MinVersion: tls.VersionTLS12}
	if opts.TLS.CAFile != "" {
		pem, err := os.ReadFile(opts.TLS.CAFile)
		if err != nil {
			return nil, fmt.Errorf("engine at %s: TLS CA (engine.tls.ca): %w", addr, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("engine at %s: TLS CA %s (engine.tls.ca) holds no PEM certificate", addr, opts.TLS.CAFile)
		}
		cfg.RootCAs = pool
	}
	if opts.TLS.CertFile != "" || opts.TLS.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(opts.TLS.CertFile, opts.TLS.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("engine at %s: TLS client certificate (engine.tls.cert and engine.tls.key): %w", addr, err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return credentials.NewTLS(cfg), nil
}

// bearer sends the token with every call.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity is false because Dial has already decided whether plaintext is
// acceptable (loopback, or Options.Insecure); gRPC's check would refuse the loopback case too.
func (bearer) RequireTransportSecurity() bool { return false }

package server

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"

	enginepb "github.com/slimen/slimen/engines/proto"
)

// Listen binds address (host:port) for a server made with the same opts. Only a loopback address
// may serve plaintext: anywhere else it needs opts.TLS, or opts.Insecure to say that an
// unencrypted engine on the network is intended (a private cluster network, a TLS-terminating
// proxy in front). Off loopback the server must also know its clients: opts.Token, or TLS that
// requires client certificates (mutual TLS); TLS alone would let anyone who reaches the port
// sample from, train, save and load the model.
func Listen(address string, opts Options) (net.Listener, error) {
	if _, _, err := net.SplitHostPort(address); err != nil {
		return nil, fmt.Errorf("listen address %q: %v; write it as host:port, e.g. 127.0.0.1:7777", address, err)
	}
	if !enginepb.IsLoopback(address) {
		if opts.TLS == nil && !opts.Insecure {
			return nil, fmt.Errorf("listen address %s is not loopback: serving an engine to the network needs TLS (--tls-cert and "+
				"--tls-key) or --insecure to accept plaintext; to serve this machine only, listen on 127.0.0.1", address)
		}
		if opts.Token == "" && !mutualTLS(opts.TLS) {
			return nil, fmt.Errorf("listen address %s is not loopback: an engine served to the network must authenticate its "+
				"clients, or anyone who reaches the port could train it and make it save and load "+
				"model folders: set a bearer token (--token-env VAR) or require client certificates "+
				"(--tls-client-ca); to serve this machine only, listen on 127.0.0.1", address)
		}
	}
	l, err := net.Listen("tcp", address)
	if err != nil {
		return nil, fmt.Errorf("engine server: %w", err)
	}
	return l, nil
}

// mutualTLS reports whether cfg makes every client present a certificate its CAs signed.
func mutualTLS(cfg *tls.Config) bool {
	return cfg != nil && cfg.ClientAuth == tls.RequireAndVerifyClientCert && cfg.ClientCAs != nil
}

// TLSConfig loads a server certificate and key (PEM files). With clientCAFile set, clients must
// present a certificate signed by one of its CAs (mutual TLS).
func TLSConfig(certFile, keyFile, clientCAFile string) (*tls.Config, error) {
	if certFile == "" || keyFile == "" {
		return nil, fmt.Errorf("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate %s with key %s: %w", certFile, keyFile, err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if clientCAFile != "" {
		pem, err := os.ReadFile(clientCAFile)
		if err != nil {
			return nil, fmt.Errorf("TLS client CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("TLS client CA %s holds no PEM certificate", clientCAFile)
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

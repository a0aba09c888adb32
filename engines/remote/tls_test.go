package remote_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/server"
)

// pki writes a CA and two certificates it signs (a server one for 127.0.0.1 and a client one)
// into dir, as PEM files named NAME.crt and NAME.key.
func pki(t *testing.T, dir string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, der []byte, key *ecdsa.PrivateKey) {
		if err := os.WriteFile(filepath.Join(dir, name+".crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		kb, _ := x509.MarshalECPrivateKey(key)
		if err := os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("ca", caDER, caKey)
	for i, leaf := range []*x509.Certificate{
		{Subject: pkix.Name{CommonName: "engine"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}},
		{Subject: pkix.Name{CommonName: "host"}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}},
	} {
		leaf.SerialNumber = big.NewInt(int64(i + 2))
		leaf.NotBefore, leaf.NotAfter = ca.NotBefore, ca.NotAfter
		leaf.KeyUsage = x509.KeyUsageDigitalSignature
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		der, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		write([]string{"server", "client"}[i], der, key)
	}
}

func TestTLS(t *testing.T) {
	dir := t.TempDir()
	pki(t, dir)
	f := func(name string) string { return filepath.Join(dir, name) }
	ctx := context.Background()

	cfg, err := server.TLSConfig(f("server.crt"), f("server.key"), f("ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, newFake(), server.Options{TLS: cfg})

	c := dial(t, remote.Options{Address: addr, TLS: &remote.TLS{CAFile: f("ca.crt"), CertFile: f("client.crt"), KeyFile: f("client.key")}})
	if _, err := c.Generate(ctx, []engines.GenerateRequest{chat("tls-1", "secret", 1)}); err != nil {
		t.Fatalf("over mutual TLS: %v", err)
	}

	// A CA that did not sign the server's certificate fails at once, not after the reconnect
	// timeout: retrying cannot fix it.
	other := t.TempDir()
	pki(t, other)
	start := time.Now()
	_, err = remote.Dial(ctx, remote.Options{Address: addr, TLS: &remote.TLS{CAFile: filepath.Join(other, "ca.crt"), CertFile: f("client.crt"), KeyFile: f("client.key")}})
	if err == nil || !strings.Contains(err.Error(), "health: the TLS handshake failed") || !strings.Contains(err.Error(), "check engine.tls") {
		t.Errorf("wrong CA: got %v", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the wrong CA took %v to report", took)
	}

	if _, err := remote.Dial(ctx, remote.Options{Address: addr, TLS: &remote.TLS{CAFile: f("missing.crt")}}); err == nil || !strings.Contains(err.Error(), "TLS CA (engine.tls.ca)") {
		t.Errorf("missing CA file: got %v", err)
	}
	if _, err := server.TLSConfig(f("server.crt"), "", ""); err == nil || !strings.Contains(err.Error(), "TLS needs both a certificate (--tls-cert) and its key (--tls-key)") {
		t.Errorf("certificate without key: got %v", err)
	}
}

// A plaintext client cannot tell a TLS server from a dead one, but its error says to look.
func TestPlaintextClientToTLSServer(t *testing.T) {
	dir := t.TempDir()
	pki(t, dir)
	cfg, err := server.TLSConfig(filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key"), "")
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, newFake(), server.Options{TLS: cfg})
	_, err = remote.Dial(context.Background(), remote.Options{Address: addr, ReconnectTimeout: 200 * time.Millisecond})
	if !errors.Is(err, remote.ErrUnavailable) || !strings.Contains(err.Error(), "whether it serves TLS (then set engine.tls)") {
		t.Errorf("got %v", err)
	}
}

package view

import (
	"context"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	enginepb "github.com/slimen/slimen/engines/proto"
)

//go:embed assets
var assets embed.FS

// runFiles are the files whose presence makes a folder a run folder: a run writes them from its
// first moments (events.log at start, config.yaml as resolved, metrics.jsonl at the first eval or
// step).
var runFiles = []string{"events.log", "metrics.jsonl", "config.yaml"}

// textFiles are the run files /api/text serves whole, by these names only.
var textFiles = map[string]bool{"config.yaml": true, "script.star": true}

// maxText bounds a file /api/text serves.
const maxText = 4 << 20

// Options configure a Server.
type Options struct {
	// Token, when not empty, is the secret every request must carry: an "Authorization: Bearer
	// TOKEN" header, the slimen_view cookie, or ?token=TOKEN (which sets the cookie). Listen
	// wants one off loopback.
	Token string
	// Graph draws the dataflow between the run's policies, for /api/graph; nil if the caller
	// cannot (the page says so). It is called once, on the first request.
	Graph func(ctx context.Context) (Drawing, error)
	// Logf reports requests that failed on the server's side; nil: the log package.
	Logf func(format string, args ...any)
}

// Drawing is the dataflow between a run's policies as the page shows it.
type Drawing struct {
	SVG     []byte
	Mermaid string
	// Policies are the drawing's policies in the order of its colours (host/graph's palette,
	// which the page's own colours follow), so a policy has one colour on the whole page.
	Policies []string
}

// Server is the page of one run folder.
type Server struct {
	dir   string
	opts  Options
	files *files
	index *rolloutIndex
	mux   *http.ServeMux

	graphOnce sync.Once
	graph     graphReply
	indexed   chan struct{} // closed when the index New starts is built
}

// New checks that dir is a run folder and returns the server of its page. The error names the
// folder and says what is wrong: missing, not a folder, or a folder no run has written to.
func New(dir string, opts Options) (*Server, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%s: no such run folder; give the --out folder of a run (runs/NAME by default)", dir)
		}
		return nil, fmt.Errorf("run folder %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is a file, not a run folder; give the --out folder of a run (runs/NAME by default)", dir)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("run folder %s: %w", dir, err)
	}
	isRun := false
	for _, name := range runFiles {
		if _, err := root.Stat(name); err == nil {
			isRun = true
		}
	}
	if !isRun {
		root.Close()
		return nil, fmt.Errorf("%s is not a run folder: it has none of %s; give the --out folder of a run (runs/NAME by default)", dir, strings.Join(runFiles, ", "))
	}
	if opts.Logf == nil {
		opts.Logf = log.Printf
	}
	f := &files{root: root, seen: map[string]seenFile{}}
	s := &Server{dir: dir, opts: opts, files: f, index: newRolloutIndex(f)}
	static, err := fs.Sub(assets, "assets")
	if err != nil {
		return nil, err
	}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		if opts.Token != "" && r.URL.Query().Has("token") {
			// The token came in the address: keep it in a cookie and take it out of the address
			// bar (and the history) at once.
			http.SetCookie(w, &http.Cookie{Name: cookieName, Value: opts.Token, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
			http.Redirect(w, r, "/", http.StatusSeeOther)
			return
		}
		serveAsset(w, static, "index.html")
	})
	s.mux.HandleFunc("GET /static/{name}", func(w http.ResponseWriter, r *http.Request) {
		serveAsset(w, static, r.PathValue("name"))
	})
	s.mux.HandleFunc("GET /api/run", s.handleRun)
	s.mux.HandleFunc("GET /api/text", s.handleText)
	s.mux.HandleFunc("GET /api/curves", s.handleCurves)
	s.mux.HandleFunc("GET /api/events", s.handleEvents)
	s.mux.HandleFunc("GET /api/rollouts", s.handleRollouts)
	s.mux.HandleFunc("GET /api/graph", s.handleGraph)
	// Index the rollouts a long run kept before the page asks for them; the first request waits
	// for what is left of it.
	s.indexed = make(chan struct{})
	go func() {
		defer close(s.indexed)
		if _, err := s.index.refresh(); err != nil {
			s.opts.Logf("slimen view: %v", err)
		}
	}()
	return s, nil
}

// Close releases the run folder, once the first index of its rollouts is done.
func (s *Server) Close() error {
	<-s.indexed
	return s.files.root.Close()
}

const cookieName = "slimen_view"

// ServeHTTP answers a request of the page, after the checks of who may ask.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.opts.Token == "" {
		// Without a token the server is bound to loopback; a page elsewhere that points a name it
		// controls at 127.0.0.1 (DNS rebinding) still sends its own name as Host, and is refused.
		if !loopbackHost(r.Host) {
			http.Error(w, "slimen view: this page answers requests to localhost or a loopback address only", http.StatusForbidden)
			return
		}
	} else if !s.authorized(r) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="slimen view"`)
		http.Error(w, "slimen view: this page needs its token: open it as http://HOST:PORT/?token=TOKEN "+
			"(the token is in the environment variable given to --token-env)", http.StatusUnauthorized)
		return
	}
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "no-referrer")
	w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'")
	s.mux.ServeHTTP(w, r)
}

func (s *Server) authorized(r *http.Request) bool {
	ok := func(got string) bool {
		return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.opts.Token)) == 1
	}
	if h := r.Header.Get("Authorization"); len(h) > 7 && strings.EqualFold(h[:7], "bearer ") {
		return ok(strings.TrimSpace(h[7:]))
	}
	if c, err := r.Cookie(cookieName); err == nil && ok(c.Value) {
		return true
	}
	return ok(r.URL.Query().Get("token"))
}

// loopbackHost reports whether a request's Host names this machine's loopback.
func loopbackHost(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Listen binds address for a server with opts. Any address but loopback needs a token: the page
// shows the run's prompts, outputs and config to whoever reaches the port.
func Listen(address string, opts Options) (net.Listener, error) {
	if !enginepb.IsLoopback(address) && opts.Token == "" {
		return nil, fmt.Errorf("listen address %s is not loopback: a run's page served to the network must ask for a token, "+
			"or anyone who reaches the port reads its prompts, outputs and config: "+
			"set one with --token-env VAR; to serve this machine only, listen on 127.0.0.1", address)
	}
	return net.Listen("tcp", address)
}

// runReply is the answer of /api/run: what the page shows first.
type runReply struct {
	Name  string          `json:"name"`
	Dir   string          `json:"dir"`
	Files map[string]bool `json:"files"`
}

func (s *Server) handleRun(w http.ResponseWriter, r *http.Request) {
	rep := runReply{Name: filepath.Base(s.dir), Dir: s.dir, Files: map[string]bool{}}
	if abs, err := filepath.Abs(s.dir); err == nil {
		rep.Name, rep.Dir = filepath.Base(abs), abs
	}
	for _, name := range []string{"metrics.jsonl", "events.log", "config.yaml", "script.star", rolloutsFile} {
		_, err := s.files.root.Stat(name)
		rep.Files[name] = err == nil
	}
	writeJSON(w, rep)
}

// handleText serves config.yaml or script.star, named by ?file=; no other name is read.
func (s *Server) handleText(w http.ResponseWriter, r *http.Request) {
	name := r.URL.Query().Get("file")
	if !textFiles[name] {
		http.Error(w, fmt.Sprintf("slimen view: %q is not a file this page shows (config.yaml, script.star)", name), http.StatusForbidden)
		return
	}
	f, err := s.files.root.Open(name)
	if errors.Is(err, fs.ErrNotExist) {
		http.Error(w, fmt.Sprintf("slimen view: the run folder has no %s", name), http.StatusNotFound)
		return
	}
	if err != nil {
		s.fail(w, err)
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	io.Copy(w, io.LimitReader(f, maxText))
}

// graphReply is the answer of /api/graph.
type graphReply struct {
	SVG      string   `json:"svg,omitempty"`
	Mermaid  string   `json:"mermaid,omitempty"`
	Policies []string `json:"policies"`
	Error    string   `json:"error,omitempty"`
}

func (s *Server) handleGraph(w http.ResponseWriter, r *http.Request) {
	s.graphOnce.Do(func() {
		s.graph.Policies = []string{}
		if s.opts.Graph == nil {
			s.graph.Error = "this server draws no dataflow graph"
			return
		}
		d, err := s.opts.Graph(context.WithoutCancel(r.Context()))
		if err != nil {
			s.graph.Error = err.Error()
			return
		}
		s.graph.SVG, s.graph.Mermaid, s.graph.Policies = string(d.SVG), d.Mermaid, d.Policies
	})
	writeJSON(w, s.graph)
}

// serveAsset writes one of the page's embedded files.
func serveAsset(w http.ResponseWriter, static fs.FS, name string) {
	b, err := fs.ReadFile(static, name)
	if err != nil {
		http.NotFound(w, nil)
		return
	}
	types := map[string]string{".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
	t, ok := types[filepath.Ext(name)]
	if !ok {
		http.NotFound(w, nil)
		return
	}
	w.Header().Set("Content-Type", t)
	w.Header().Set("Cache-Control", "no-cache")
	w.Write(b)
}

// offsetParams reads a tail request's ?from= (a byte offset; -1 where the endpoint takes it as
// "the end") and ?gen= (the generation of the file those offsets point into).
func offsetParams(w http.ResponseWriter, r *http.Request) (from int64, gen int, ok bool) {
	q := r.URL.Query()
	var err error
	if v := q.Get("from"); v != "" {
		if from, err = strconv.ParseInt(v, 10, 64); err != nil || from < -1 {
			http.Error(w, fmt.Sprintf("slimen view: from=%q is not a byte offset", v), http.StatusBadRequest)
			return 0, 0, false
		}
	}
	if v := q.Get("gen"); v != "" {
		if gen, err = strconv.Atoi(v); err != nil || gen < 0 {
			http.Error(w, fmt.Sprintf("slimen view: gen=%q is not a file generation", v), http.StatusBadRequest)
			return 0, 0, false
		}
	}
	return from, gen, true
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	json.NewEncoder(w).Encode(v)
}

// fail answers a request that failed on the server's side (a file it could not read), and logs it.
func (s *Server) fail(w http.ResponseWriter, err error) {
	s.opts.Logf("slimen view: %v", err)
	http.Error(w, "slimen view: "+err.Error(), http.StatusInternalServerError)
}

package view

import (
	"encoding/json"
	"fmt"
	"iter"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"
)

// rolloutsFile is where a run keeps the rollouts it saves (run.save_rollouts).
const rolloutsFile = "rollouts.jsonl"

// indexChunk is how many bytes of rollouts.jsonl one refresh of the index reads at a time.
const indexChunk = 4 << 20

// rolloutEntry is what the index keeps of one line of rollouts.jsonl: where it is and what the
// filters ask about, not the rollout itself, which a page of results reads from the file.
type rolloutEntry struct {
	off     int64
	n       int32
	step    int32
	eval    bool
	failed  bool
	rewards []policyReward // one per call that has a reward
	pols    []uint16       // the policies of its calls, as indexes into rolloutIndex.policies
}

type policyReward struct {
	policy int32
	reward float32
}

// rolloutIndex indexes rollouts.jsonl as it grows: each refresh reads only the bytes past what it
// has indexed, so a request of a long run's page costs the lines it shows, not the file.
type rolloutIndex struct {
	files *files
	mu    sync.Mutex
	gen   int
	end   int64 // the offset indexed up to: just past a newline
	items []rolloutEntry
	bad   []int64 // offsets of lines that are not a rollout record
	// policies interns policy names; polID finds them.
	policies []string
	polID    map[string]uint16
	minStep  int32
	maxStep  int32
}

func newRolloutIndex(f *files) *rolloutIndex {
	return &rolloutIndex{files: f, polID: map[string]uint16{}}
}

// rolloutHead is the part of a record the index reads.
type rolloutHead struct {
	Step  *int   `json:"step"`
	Eval  bool   `json:"eval"`
	Error string `json:"error"`
	Calls []struct {
		Policy string   `json:"policy"`
		Reward *float64 `json:"reward"`
	} `json:"calls"`
}

// refresh brings the index up to the file's complete lines.
func (x *rolloutIndex) refresh() (exists bool, err error) {
	size, gen, exists, err := x.files.stat(rolloutsFile)
	if err != nil || !exists {
		return exists, err
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if gen != x.gen {
		// Another file than the one indexed: a resumed run cut the steps after its checkpoint.
		x.gen, x.end, x.items, x.bad, x.policies, x.polID = gen, 0, nil, nil, nil, map[string]uint16{}
	}
	for x.end < size {
		data, end, err := x.files.lines(rolloutsFile, x.end, indexChunk)
		if err != nil {
			return true, err
		}
		if end == x.end {
			break // a line not finished yet
		}
		eachLine(data, x.end, func(line []byte, off int64) {
			x.add(line, off)
		})
		x.end = end
	}
	return true, nil
}

func (x *rolloutIndex) add(line []byte, off int64) {
	var h rolloutHead
	if err := json.Unmarshal(line, &h); err != nil || h.Step == nil {
		x.bad = append(x.bad, off)
		return
	}
	e := rolloutEntry{off: off, n: int32(min(len(line), math.MaxInt32)), step: int32(*h.Step), eval: h.Eval, failed: h.Error != ""}
	for _, c := range h.Calls {
		id, ok := x.polID[c.Policy]
		if !ok && len(x.policies) < math.MaxUint16 {
			id = uint16(len(x.policies))
			x.polID[c.Policy] = id
			x.policies = append(x.policies, c.Policy)
		}
		if !slices.Contains(e.pols, id) {
			e.pols = append(e.pols, id)
		}
		if c.Reward != nil {
			e.rewards = append(e.rewards, policyReward{int32(id), float32(*c.Reward)})
		}
	}
	if len(x.items) == 0 || e.step < x.minStep {
		x.minStep = e.step
	}
	if len(x.items) == 0 || e.step > x.maxStep {
		x.maxStep = e.step
	}
	x.items = append(x.items, e)
}

// order yields the positions of the indexed rollouts in file order, or with the newest step
// first: the file holds a step's lines together, appended after the step before's, so newest first
// is its runs of one step from the last, each in its own order (index 0 first).
func (x *rolloutIndex) order(newestFirst bool) iter.Seq[int] {
	return func(yield func(int) bool) {
		if !newestFirst {
			for k := range x.items {
				if !yield(k) {
					return
				}
			}
			return
		}
		for end := len(x.items); end > 0; {
			start := end - 1
			for start > 0 && x.items[start-1].step == x.items[end-1].step {
				start--
			}
			for k := start; k < end; k++ {
				if !yield(k) {
					return
				}
			}
			end = start
		}
	}
}

// rolloutFilter is what a page of rollouts asks for.
type rolloutFilter struct {
	policy               string // "" any
	minStep, maxStep     int
	minReward, maxReward float64
	hasReward            bool   // a reward range was given
	status               string // "", "failed", "ok"
	kind                 string // "", "train", "eval"
	page, perPage        int
	newestFirst          bool
	policyID             int32
	policyKnown          bool
}

func parseFilter(r *http.Request) (rolloutFilter, error) {
	q := r.URL.Query()
	f := rolloutFilter{policy: q.Get("policy"), status: q.Get("status"), kind: q.Get("kind"), perPage: 20, newestFirst: q.Get("order") != "asc",
		minStep: math.MinInt32, maxStep: math.MaxInt32, minReward: math.Inf(-1), maxReward: math.Inf(1)}
	ints := []struct {
		key string
		dst *int
		min int
	}{{"min_step", &f.minStep, math.MinInt32}, {"max_step", &f.maxStep, math.MinInt32}, {"page", &f.page, 0}, {"per_page", &f.perPage, 1}}
	for _, p := range ints {
		if v := q.Get(p.key); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < p.min {
				return f, fmt.Errorf("%s=%q is not a whole number of at least %d", p.key, v, p.min)
			}
			*p.dst = n
		}
	}
	if v := q.Get("step"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return f, fmt.Errorf("step=%q is not a step number", v)
		}
		f.minStep, f.maxStep = n, n
	}
	f.perPage = min(f.perPage, 200)
	if f.page > math.MaxInt32 {
		return f, fmt.Errorf("page=%d is past any run's rollouts", f.page)
	}
	floats := []struct {
		key string
		dst *float64
	}{{"min_reward", &f.minReward}, {"max_reward", &f.maxReward}}
	for _, p := range floats {
		if v := q.Get(p.key); v != "" {
			x, err := strconv.ParseFloat(v, 64)
			if err != nil || math.IsNaN(x) {
				return f, fmt.Errorf("%s=%q is not a number", p.key, v)
			}
			*p.dst, f.hasReward = x, true
		}
	}
	if f.minReward > f.maxReward {
		return f, fmt.Errorf("min_reward %v is above max_reward %v", f.minReward, f.maxReward)
	}
	if !slices.Contains([]string{"", "failed", "ok"}, f.status) {
		return f, fmt.Errorf("status=%q: give failed, ok or nothing", f.status)
	}
	if !slices.Contains([]string{"", "train", "eval"}, f.kind) {
		return f, fmt.Errorf("kind=%q: give train, eval or nothing", f.kind)
	}
	return f, nil
}

func (f rolloutFilter) match(e *rolloutEntry) bool {
	if int(e.step) < f.minStep || int(e.step) > f.maxStep {
		return false
	}
	switch {
	case f.status == "failed" && !e.failed, f.status == "ok" && e.failed:
		return false
	case f.kind == "eval" && !e.eval, f.kind == "train" && e.eval:
		return false
	}
	if f.policy != "" && (!f.policyKnown || !slices.Contains(e.pols, uint16(f.policyID))) {
		return false
	}
	if !f.hasReward {
		return true
	}
	// A reward range keeps a rollout with a reward in it: one of the policy's calls when a policy
	// is chosen, else any call's.
	for _, r := range e.rewards {
		if (f.policy == "" || r.policy == f.policyID) && float64(r.reward) >= f.minReward && float64(r.reward) <= f.maxReward {
			return true
		}
	}
	return false
}

// rolloutsReply is the answer of /api/rollouts: one page of the rollouts that match.
type rolloutsReply struct {
	Exists   bool              `json:"exists"`
	Total    int               `json:"total"`   // rollouts that match
	Indexed  int               `json:"indexed"` // rollouts in the file
	Bad      int               `json:"bad"`     // lines that are not a rollout record
	Page     int               `json:"page"`
	PerPage  int               `json:"per_page"`
	Policies []string          `json:"policies"`
	MinStep  int               `json:"min_step"`
	MaxStep  int               `json:"max_step"`
	Items    []json.RawMessage `json:"items"`
}

func (s *Server) handleRollouts(w http.ResponseWriter, r *http.Request) {
	f, err := parseFilter(r)
	if err != nil {
		http.Error(w, "slimen view: "+err.Error(), http.StatusBadRequest)
		return
	}
	exists, err := s.index.refresh()
	if err != nil {
		s.fail(w, err)
		return
	}
	rep := rolloutsReply{Exists: exists, Page: f.page, PerPage: f.perPage, Policies: []string{}, Items: []json.RawMessage{}}
	x := s.index
	x.mu.Lock()
	rep.Indexed, rep.Bad = len(x.items), len(x.bad)
	rep.Policies = append(rep.Policies, x.policies...)
	slices.Sort(rep.Policies)
	rep.MinStep, rep.MaxStep = int(x.minStep), int(x.maxStep)
	id, ok := x.polID[f.policy]
	f.policyID, f.policyKnown = int32(id), ok
	var picked []rolloutEntry
	skip := f.page * f.perPage
	for k := range x.order(f.newestFirst) {
		e := &x.items[k]
		if !f.match(e) {
			continue
		}
		if rep.Total >= skip && len(picked) < f.perPage {
			picked = append(picked, *e)
		}
		rep.Total++
	}
	x.mu.Unlock()
	if rep.Items, err = s.readRollouts(picked); err != nil {
		s.fail(w, err)
		return
	}
	writeJSON(w, rep)
}

// readRollouts reads the indexed rollout records of one page.
func (s *Server) readRollouts(picked []rolloutEntry) ([]json.RawMessage, error) {
	out := []json.RawMessage{}
	if len(picked) == 0 {
		return out, nil
	}
	fh, err := s.files.root.Open(rolloutsFile)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	for _, e := range picked {
		b := make([]byte, e.n)
		if _, err := fh.ReadAt(b, e.off); err != nil {
			return nil, fmt.Errorf("%s at byte %d: %w", rolloutsFile, e.off, err)
		}
		if !json.Valid(b) {
			return nil, fmt.Errorf("%s changed under the page at byte %d; reload the page", rolloutsFile, e.off)
		}
		out = append(out, b)
	}
	return out, nil
}

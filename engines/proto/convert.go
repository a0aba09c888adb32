package enginepb

import (
	"math"
	"net"
	"strings"

	"github.com/slimen/slimen/engines"
)

// The conversions below are the only place that knows both the Go types and the wire messages,
// so that a field added to engines/engine.go needs one edit here (and one in engine.proto).
// Go ints travel as int32 or int64 as the proto declares them.

// EncodeInfo converts engines.Info to its message.
func EncodeInfo(in engines.Info) *Info {
	return &Info{
		Model:        in.Model,
		Architecture: in.Architecture,
		VocabSize:    int64(in.VocabSize),
		MaxSeqLen:    int64(in.MaxSeqLen),
		ChatTemplate: in.ChatTemplate,
		EosTokens:    in.EOSTokens,
		Params:       in.Params,
		Devices:      in.Devices,
		Capabilities: in.Capabilities,
	}
}

// DecodeInfo converts an Info message to engines.Info.
func DecodeInfo(m *Info) engines.Info {
	return engines.Info{
		Model:        m.GetModel(),
		Architecture: m.GetArchitecture(),
		VocabSize:    int(m.GetVocabSize()),
		MaxSeqLen:    int(m.GetMaxSeqLen()),
		ChatTemplate: m.GetChatTemplate(),
		EOSTokens:    m.GetEosTokens(),
		Params:       m.GetParams(),
		Devices:      m.GetDevices(),
		Capabilities: m.GetCapabilities(),
	}
}

func encodeMessages(ms []engines.Message) []*Message {
	if ms == nil {
		return nil
	}
	out := make([]*Message, len(ms))
	for i, m := range ms {
		out[i] = &Message{Role: m.Role, Content: m.Content}
	}
	return out
}

func decodeMessages(ms []*Message) []engines.Message {
	if ms == nil {
		return nil
	}
	out := make([]engines.Message, len(ms))
	for i, m := range ms {
		out[i] = engines.Message{Role: m.GetRole(), Content: m.GetContent()}
	}
	return out
}

// EncodeGenerateRequest converts an engines.GenerateRequest to its message.
func EncodeGenerateRequest(r engines.GenerateRequest) *GenerateRequest {
	return &GenerateRequest{
		Id:           r.ID,
		Messages:     encodeMessages(r.Messages),
		PromptTokens: r.PromptTokens,
		N:            int32(r.N),
		Sampling: &Sampling{
			MaxTokens:   int32(min(r.MaxTokens, math.MaxInt32)), // saturated: a larger value must not wrap to a few tokens
			Temperature: r.Temperature,
			TopP:        r.TopP,
			Stop:        r.Stop,
			Seed:        r.Seed,
			Constraint:  r.Constraint,
		},
	}
}

// DecodeGenerateRequest converts a GenerateRequest message to an engines.GenerateRequest.
func DecodeGenerateRequest(m *GenerateRequest) engines.GenerateRequest {
	s := m.GetSampling()
	return engines.GenerateRequest{
		ID:           m.GetId(),
		Messages:     decodeMessages(m.GetMessages()),
		PromptTokens: m.GetPromptTokens(),
		N:            int(m.GetN()),
		Sampling: engines.Sampling{
			MaxTokens:   int(s.GetMaxTokens()),
			Temperature: s.GetTemperature(),
			TopP:        s.GetTopP(),
			Stop:        s.GetStop(),
			Seed:        s.GetSeed(),
			Constraint:  s.GetConstraint(),
		},
	}
}

// EncodeCompletion converts an engines.Completion to its message.
func EncodeCompletion(c engines.Completion) *Completion {
	return &Completion{
		RequestId:    c.RequestID,
		Index:        int32(c.Index),
		PromptTokens: c.PromptTokens,
		Tokens:       c.Tokens,
		Logprobs:     c.Logprobs,
		Text:         c.Text,
		FinishReason: c.FinishReason,
	}
}

// DecodeCompletion converts a Completion message to an engines.Completion.
func DecodeCompletion(m *Completion) engines.Completion {
	return engines.Completion{
		RequestID:    m.GetRequestId(),
		Index:        int(m.GetIndex()),
		PromptTokens: m.GetPromptTokens(),
		Tokens:       m.GetTokens(),
		Logprobs:     m.GetLogprobs(),
		Text:         m.GetText(),
		FinishReason: m.GetFinishReason(),
	}
}

// EncodeScoreRequest converts an engines.ScoreRequest to its message.
func EncodeScoreRequest(r engines.ScoreRequest) *ScoreRequest {
	return &ScoreRequest{Messages: encodeMessages(r.Messages), PromptTokens: r.PromptTokens, Tokens: r.Tokens, Reference: r.Reference}
}

// DecodeScoreRequest converts a ScoreRequest message to an engines.ScoreRequest.
func DecodeScoreRequest(m *ScoreRequest) engines.ScoreRequest {
	return engines.ScoreRequest{
		Messages:     decodeMessages(m.GetMessages()),
		PromptTokens: m.GetPromptTokens(),
		Tokens:       m.GetTokens(),
		Reference:    m.GetReference(),
	}
}

// EncodeBatch converts an engines.Batch to its message.
func EncodeBatch(b engines.Batch) *Batch {
	samples := make([]*Sample, len(b.Samples))
	for i, s := range b.Samples {
		samples[i] = &Sample{
			Prompt:        s.Prompt,
			Response:      s.Response,
			LossMask:      s.LossMask,
			OldLogprobs:   s.OldLogprobs,
			Advantages:    s.Advantages,
			Group:         s.Group,
			Returns:       s.Returns,
			OldValues:     s.OldValues,
			TrainLogprobs: s.TrainLogprobs,
		}
	}
	l := b.Loss
	return &Batch{
		Id:      b.ID,
		Samples: samples,
		Loss: &LossConfig{
			Lr:          l.LR,
			Beta1:       l.Beta1,
			Beta2:       l.Beta2,
			AdamEps:     l.AdamEps,
			WeightDecay: l.WeightDecay,
			MaxGradNorm: l.MaxGradNorm,
			EpsClip:     l.EpsClip,
			EpsClipHigh: l.EpsClipHigh,
			KlLossCoef:  l.KLLossCoef,
			KlLossType:  l.KLLossType,
			EntropyCoef: l.EntropyCoef,
			PolicyLoss:  l.PolicyLoss,
			Aggregation: l.Aggregation,
			ValueClip:   l.ValueClip,
			UseTis:      l.UseTIS,
			TisMode:     l.TISMode,
			TisClip:     l.TISClip,
			TisClipLow:  l.TISClipLow,
		},
	}
}

// DecodeBatch converts a Batch message to an engines.Batch.
func DecodeBatch(m *Batch) engines.Batch {
	var samples []engines.Sample
	if len(m.GetSamples()) > 0 {
		samples = make([]engines.Sample, len(m.GetSamples()))
	}
	for i, s := range m.GetSamples() {
		samples[i] = engines.Sample{
			Prompt:        s.GetPrompt(),
			Response:      s.GetResponse(),
			LossMask:      s.GetLossMask(),
			OldLogprobs:   s.GetOldLogprobs(),
			Advantages:    s.GetAdvantages(),
			Group:         s.GetGroup(),
			Returns:       s.GetReturns(),
			OldValues:     s.GetOldValues(),
			TrainLogprobs: s.GetTrainLogprobs(),
		}
	}
	l := m.GetLoss()
	return engines.Batch{
		ID:      m.GetId(),
		Samples: samples,
		Loss: engines.LossConfig{
			LR:          l.GetLr(),
			Beta1:       l.GetBeta1(),
			Beta2:       l.GetBeta2(),
			AdamEps:     l.GetAdamEps(),
			WeightDecay: l.GetWeightDecay(),
			MaxGradNorm: l.GetMaxGradNorm(),
			EpsClip:     l.GetEpsClip(),
			EpsClipHigh: l.GetEpsClipHigh(),
			KLLossCoef:  l.GetKlLossCoef(),
			KLLossType:  l.GetKlLossType(),
			EntropyCoef: l.GetEntropyCoef(),
			PolicyLoss:  l.GetPolicyLoss(),
			Aggregation: l.GetAggregation(),
			ValueClip:   l.GetValueClip(),
			UseTIS:      l.GetUseTis(),
			TISMode:     l.GetTisMode(),
			TISClip:     l.GetTisClip(),
			TISClipLow:  l.GetTisClipLow(),
		},
	}
}

// EncodeTrainStats converts engines.TrainStats to its message.
func EncodeTrainStats(s engines.TrainStats) *TrainStats {
	return &TrainStats{
		Loss:            s.Loss,
		PgLoss:          s.PGLoss,
		Kl:              s.KL,
		ClipFrac:        s.ClipFrac,
		Entropy:         s.Entropy,
		GradNorm:        s.GradNorm,
		Tokens:          int64(s.Tokens),
		Skipped:         s.Skipped,
		Reason:          s.Reason,
		ValueLoss:       s.ValueLoss,
		TisClipFrac:     s.TISClipFrac,
		TisWeight:       s.TISWeight,
		LogprobDiffMean: s.LogprobDiffMean,
		LogprobDiffMax:  s.LogprobDiffMax,
		LogprobAbsDiff:  s.LogprobAbsDiff,
	}
}

// DecodeTrainStats converts a TrainStats message to engines.TrainStats.
func DecodeTrainStats(m *TrainStats) engines.TrainStats {
	return engines.TrainStats{
		Loss:            m.GetLoss(),
		PGLoss:          m.GetPgLoss(),
		KL:              m.GetKl(),
		ClipFrac:        m.GetClipFrac(),
		Entropy:         m.GetEntropy(),
		GradNorm:        m.GetGradNorm(),
		Tokens:          int(m.GetTokens()),
		Skipped:         m.GetSkipped(),
		Reason:          m.GetReason(),
		ValueLoss:       m.GetValueLoss(),
		TISClipFrac:     m.GetTisClipFrac(),
		TISWeight:       m.GetTisWeight(),
		LogprobDiffMean: m.GetLogprobDiffMean(),
		LogprobDiffMax:  m.GetLogprobDiffMax(),
		LogprobAbsDiff:  m.GetLogprobAbsDiff(),
	}
}

// IsLoopback reports whether address (host:port) names this machine only: "localhost" or a
// loopback IP. Names are not resolved, so a name that happens to resolve to 127.0.0.1 still counts
// as remote; the protocol's rule is that plaintext is only safe where nobody else can listen in.
func IsLoopback(address string) bool {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// EncodeRenderRequest converts an engines.RenderRequest.
func EncodeRenderRequest(r engines.RenderRequest) *RenderRequest {
	return &RenderRequest{Messages: encodeMessages(r.Messages), Tools: r.Tools, AddGenerationPrompt: r.AddGenerationPrompt}
}

// DecodeRenderRequest converts a RenderRequest.
func DecodeRenderRequest(r *RenderRequest) engines.RenderRequest {
	return engines.RenderRequest{Messages: decodeMessages(r.GetMessages()), Tools: r.GetTools(), AddGenerationPrompt: r.GetAddGenerationPrompt()}
}
